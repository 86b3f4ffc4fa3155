"""Paged attention, chosen by device and build:

- CPU with the native op built (cpu_attention.cpp, replicas/kernels/native_build.py): one call per layer over
  the step's whole varlen batch, straight from the block tables (the batch has no `groups`);
- CUDA with triton importable: the decode group through the Triton block-table kernel (triton_decode.py), the
  cache writes through triton_store.py, prefill chunks on PyTorch SDPA over gathered keys (naive.py);
- otherwise the PyTorch reference (naive.py) over the batch's padded groups; a sliding window or a soft-cap
  there runs the varlen reference (naive_varlen_attention), which has both.

    paged_attention(q, k_cache, v_cache, batch, scale, sliding_window=0, softcap=0.0) -> out   q, out: [T, H, D]
    store_kvcache(k, v, k_cache, v_cache, slot_mapping, native=False)                         k, v: [T, Hkv, D]

`batch` is the step's ForwardBatch (replicas/models/forward_batch.py): `groups`, or, where they are None,
`query_start_loc`, `seq_lens` and `block_table` for the native op, which honours `batch_invariant` (each row's
bits independent of the rest of the batch; see cpu_native.py).
"""

import functools

import torch

from replicas.kernels.paged_attention.cpu_native import cpu_paged_attention, cpu_store_kvcache, native_ops
from replicas.kernels.paged_attention.naive import (AttentionGroup, naive_group_attention, naive_paged_attention,
                                                    naive_paged_decode_attention, naive_varlen_attention)
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


def can_use_native_attention(device: torch.device) -> bool:
    """The native CPU op is built (once per host; the first call may build it)."""
    return device.type == "cpu" and native_ops() is not None


def uses_native_attention(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model`'s attention layers were set to the native op (by the loader)."""
    return device.type == "cpu" and bool(getattr(model, "native_attention", False))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    # q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] -> out: [T, H, D]
    if batch.groups is None:
        return cpu_paged_attention(q.contiguous(), k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                   batch.block_table, scale, sliding_window, softcap,
                                   getattr(batch, "batch_invariant", False))
    if sliding_window or softcap:  # the reference: correct on any device, a loop over sequences
        return naive_varlen_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                      scale, sliding_window, softcap)
    if not use_triton(q):
        return naive_paged_attention(q, k_cache, v_cache, batch.groups, scale)
    paged_decode_attention = _triton_ops()[0]
    out = torch.empty_like(q)
    for g in batch.groups:  # at most two: decode rows, prefill chunks
        if g.query_index.shape[1] == 1:  # decode: every row valid, one query at position context_len - 1
            rows = g.query_index[:, 0]  # [B]
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, g.block_tables, g.context_lens, scale)
        else:
            naive_group_attention(q, k_cache, v_cache, g, scale, out)
    return out


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, native: bool = False) -> None:
    if native:
        return cpu_store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    if use_triton(k):
        return _triton_ops()[1](k, v, k_cache, v_cache, slot_mapping)
    return naive_store_kvcache(k, v, k_cache, v_cache, slot_mapping)


__all__ = ["AttentionGroup", "can_use_native_attention", "naive_paged_attention", "naive_paged_decode_attention",
           "naive_store_kvcache", "naive_varlen_attention", "paged_attention", "store_kvcache", "use_triton",
           "uses_native_attention"]
