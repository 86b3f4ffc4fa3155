"""Gated delta rule: fla's Triton kernels on CUDA when `fla` (fla-core) is importable, else the references.

`chunk_gated_delta_rule` (prefill chunks) and `fused_recurrent_gated_delta_rule` (decode rows) share one
signature with their references in naive.py (fla's):

    (q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
     use_qk_l2norm_in_kernel=False) -> (o [B, T, HV, V], final_state [N, HV, K, V] float32 or None)
"""

import functools

import torch

from replicas.kernels.gated_delta_rule.naive import (l2norm, naive_chunk_gated_delta_rule,
                                                     naive_recurrent_gated_delta_rule)


@functools.cache
def _fla_ops():
    """fla's launchers, or None. Imported on first CUDA use only: importing fla needs triton."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or no working triton
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and _fla_ops() is not None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Prefill: fla's chunked Triton kernel on CUDA, else the reference."""
    return _dispatch(0, naive_chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Decode: fla's fused recurrent Triton kernel on CUDA, else the reference."""
    return _dispatch(1, naive_recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state,
                     output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def _dispatch(which: int, reference, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
              use_qk_l2norm_in_kernel):
    if not use_fla(q):
        return reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         use_qk_l2norm_in_kernel)
    q, k = _expand_heads(q, k, v)
    return _fla_ops()[which](q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # Not every fla release takes HV > H; repeating q/k per value head is exact for all of them.
    group = v.shape[2] // q.shape[2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "l2norm", "naive_chunk_gated_delta_rule",
           "naive_recurrent_gated_delta_rule", "use_fla"]
