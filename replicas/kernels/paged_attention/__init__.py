"""Paged attention: the PyTorch reference on CPU; on CUDA (with triton importable) the decode group goes through
the Triton block-table kernel (triton_decode.py) and the cache writes through triton_store.py. The prefill group
stays on PyTorch SDPA over gathered keys (naive.py) everywhere.

    paged_attention(q, k_cache, v_cache, groups, scale) -> out      q, out: [T, H, D]
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)             k, v: [T, Hkv, D]
"""

import functools

import torch

from replicas.kernels.paged_attention.naive import (AttentionGroup, naive_group_attention, naive_paged_attention,
                                                    naive_paged_decode_attention)
from replicas.kernels.paged_attention.naive import store_kvcache as naive_store_kvcache


@functools.cache
def _triton_ops():
    """(paged_decode_attention, store_kvcache) launchers, or None. Imported on first CUDA use only."""
    try:
        from replicas.kernels.paged_attention.triton_decode import paged_decode_attention
        from replicas.kernels.paged_attention.triton_store import store_kvcache as triton_store_kvcache
    except Exception:  # not installed, or no working triton
        return None
    return paged_decode_attention, triton_store_kvcache


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_ops() is not None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[AttentionGroup],
                    scale: float) -> torch.Tensor:
    # q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] -> out: [T, H, D]
    if not use_triton(q):
        return naive_paged_attention(q, k_cache, v_cache, groups, scale)
    paged_decode_attention = _triton_ops()[0]
    out = torch.empty_like(q)
    for g in groups:  # at most two: decode rows, prefill chunks
        if g.query_index.shape[1] == 1:  # decode: every row valid, one query at position context_len - 1
            rows = g.query_index[:, 0]  # [B]
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, g.block_tables, g.context_lens, scale)
        else:
            naive_group_attention(q, k_cache, v_cache, g, scale, out)
    return out


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    if use_triton(k):
        return _triton_ops()[1](k, v, k_cache, v_cache, slot_mapping)
    return naive_store_kvcache(k, v, k_cache, v_cache, slot_mapping)


__all__ = ["AttentionGroup", "naive_paged_attention", "naive_paged_decode_attention", "naive_store_kvcache",
           "paged_attention", "store_kvcache", "use_triton"]
