"""Single CPU ops in isolation, at SmolLM2-135M's shapes: the native kernels against PyTorch, the sampler."""
