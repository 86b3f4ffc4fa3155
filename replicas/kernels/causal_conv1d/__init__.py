"""Causal depthwise conv1d: the PyTorch references on every device; a Triton kernel for CUDA comes with the
speed step (same signatures)."""

from replicas.kernels.causal_conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update

causal_conv1d = naive_causal_conv1d
causal_conv1d_update = naive_causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d", "naive_causal_conv1d_update"]
