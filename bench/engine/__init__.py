"""The in-process Engine: decode and prefill throughput, A/B of its knobs, where a step goes, its caches."""
