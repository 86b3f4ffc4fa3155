"""store_kvcache, Triton: this step's keys and values into their cache slots (nano-vllm's kernel).

Spec: store_kvcache in naive.py, same signature. One program per token copies its Hkv * D keys and values;
a slot of -1 is skipped (a row that writes nothing).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def store_kvcache_kernel(k, v, k_cache, v_cache, slot_mapping, stride_k, stride_v, HKVD: tl.constexpr,
                         BKV: tl.constexpr):
    # k: [T, HKVD] rows stride_k apart; v: [T, HKVD] rows stride_v apart; k_cache, v_cache: [num_slots, HKVD]
    i_t = tl.program_id(0)
    slot = tl.load(slot_mapping + i_t).to(tl.int64)
    if slot == -1:
        return
    o_kv = tl.arange(0, BKV)
    m_kv = o_kv < HKVD
    b_k = tl.load(k + i_t * stride_k + o_kv, mask=m_kv)
    b_v = tl.load(v + i_t * stride_v + o_kv, mask=m_kv)
    tl.store(k_cache + slot * HKVD + o_kv, b_k, mask=m_kv)
    tl.store(v_cache + slot * HKVD + o_kv, b_v, mask=m_kv)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D] (each token's Hkv * D values contiguous); k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    # slot_mapping: [T]
    T, HKV, D = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == D and v.stride(1) == D
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (HKV, D)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and slot_mapping.numel() == T
    if T == 0:
        return
    store_kvcache_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), HKVD=HKV * D,
                               BKV=triton.next_power_of_2(HKV * D))
