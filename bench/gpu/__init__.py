"""On a CUDA machine, by hand: kernel parity, kernel and decode-step timings (run by gpu_check.sh)."""
