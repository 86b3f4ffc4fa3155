"""Paged attention: the PyTorch reference on CPU; a Triton kernel for CUDA comes with the speed step."""

from replicas.kernels.paged_attention.naive import AttentionGroup, naive_paged_attention, store_kvcache

paged_attention = naive_paged_attention

__all__ = ["AttentionGroup", "naive_paged_attention", "paged_attention", "store_kvcache"]
