"""Paged decode attention, Triton: one query per sequence over its block table (the decode group's rows).

Spec: naive_paged_decode_attention (naive.py), same signature. One program per (sequence, KV head, split)
computes the G = H / Hkv query heads that share the KV head, so each key and value row is read once for
the whole group; the G heads are padded to BG >= 16 rows to feed tl.dot. Keys are walked in tiles of BT
positions, each position finding its slot through the block table, so BT does not depend on block_size:

    position t of sequence b:  block_tables[b, t // BS] * BS + t % BS      (BS = block_size)

Online softmax, float32 accumulation. Flash-decoding: with few sequences (B * Hkv programs cannot fill
the GPU) the context is cut into NUM_SPLITS ranges of SPLIT_SIZE positions; each split writes a
normalised partial output and its logsumexp, and paged_decode_reduce_kernel merges them.

The interpreter (TRITON_INTERPRET=1, CPU tensors: the parity tests here and in CI) computes bfloat16 on the
raw bit patterns, tl.dot included, so under it values are upcast to float32 right after each load
(IS_INTERPRET). bf16 -> fp32 is exact and the dot accumulates in float32 either way: the numbers match.
"""

import functools

import torch
import triton
import triton.language as tl

MIN_SPLIT_SIZE = 128  # positions: shorter splits cost more in the merge than they win in parallelism


@triton.jit
def _dot(a, b, IS_INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if IS_INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def paged_decode_attention_kernel(q, k_cache, v_cache, o, o_partial, lse_partial, block_tables, context_lens,
                                  scale, N, SPLIT_SIZE,
                                  H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                  BS: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                                  NUM_SPLITS: tl.constexpr, IS_INTERPRET: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr):
    # q, o: [B, H, D]; k_cache, v_cache: [num_blocks, BS, HKV, D]; block_tables: [B, N]; context_lens: [B]
    # o_partial: [B, H, NUM_SPLITS, D] float32; lse_partial: [B, H, NUM_SPLITS] float32 (NUM_SPLITS > 1 only)
    i_b, i_hkv, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_g = o_g < G
    m_d = o_d < D
    o_h = i_hkv * G + o_g  # [BG] query heads of this KV head

    p_q = q + (i_b * H + o_h)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.)  # [BG, BD]
    if IS_INTERPRET:
        b_q = b_q.to(tl.float32)

    context_len = tl.load(context_lens + i_b)
    start = i_s * SPLIT_SIZE
    end = tl.minimum(start + SPLIT_SIZE, context_len)

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)
    # Every tile holds at least one position < end, so b_m is finite after the first one.
    for i_t in range(start, end, BT):
        o_t = i_t + tl.arange(0, BT)
        m_t = o_t < end
        b_block = tl.load(block_tables + i_b * N + o_t // BS, mask=m_t, other=0).to(tl.int64)  # [BT]
        o_slot = b_block * BS + o_t % BS  # [BT]
        o_kv = (o_slot * HKV + i_hkv)[:, None] * D + o_d[None, :]  # [BT, BD]
        m_kv = m_t[:, None] & m_d[None, :]
        b_k = tl.load(k_cache + o_kv, mask=m_kv, other=0.)  # [BT, BD]
        b_s = _dot(b_q, tl.trans(b_k), IS_INTERPRET, DOT_PRECISION) * scale  # [BG, BT]
        b_s = tl.where(m_t[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])  # [BG, BT]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(v_cache + o_kv, mask=m_kv, other=0.)  # [BT, BD]
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(v_cache.dtype.element_ty), b_v, IS_INTERPRET,
                                                DOT_PRECISION)
        b_m = b_m_new

    b_o = b_acc / tl.where(b_l > 0, b_l, 1.)[:, None]  # a split past the context has no keys: zeros
    m_o = m_g[:, None] & m_d[None, :]
    if NUM_SPLITS == 1:
        p_o = o + (i_b * H + o_h)[:, None] * D + o_d[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o)
    else:
        p_o = o_partial + ((i_b * H + o_h) * NUM_SPLITS + i_s)[:, None] * D + o_d[None, :]
        tl.store(p_o, b_o, mask=m_o)
        b_lse = tl.where(b_l > 0, b_m + tl.log(tl.where(b_l > 0, b_l, 1.)), float("-inf"))  # [BG]
        tl.store(lse_partial + (i_b * H + o_h) * NUM_SPLITS + i_s, b_lse, mask=m_g)


@triton.jit
def paged_decode_reduce_kernel(o_partial, lse_partial, o, H: tl.constexpr, D: tl.constexpr,
                               NUM_SPLITS: tl.constexpr, BSPLIT: tl.constexpr, BD: tl.constexpr):
    # o_partial: [B, H, NUM_SPLITS, D] float32; lse_partial: [B, H, NUM_SPLITS] -> o: [B, H, D]
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_s = tl.arange(0, BSPLIT)
    o_d = tl.arange(0, BD)
    m_s = o_s < NUM_SPLITS
    m_d = o_d < D
    i_bh = i_b * H + i_h
    b_lse = tl.load(lse_partial + i_bh * NUM_SPLITS + o_s, mask=m_s, other=float("-inf"))  # [BSPLIT]
    b_w = tl.exp(b_lse - tl.max(b_lse, 0))  # split 0 always holds keys: the max is finite
    p_o = o_partial + (i_bh * NUM_SPLITS + o_s)[:, None] * D + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & m_d[None, :], other=0.)  # [BSPLIT, BD]
    b_o = tl.sum(b_w[:, None] * b_o, 0) / tl.sum(b_w, 0)  # [BD]
    tl.store(o + i_bh * D + o_d, b_o.to(o.dtype.element_ty), mask=m_d)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, N] int32 (padding ->
    block 0, N * block_size >= every context_len); context_lens: [B] int32, each >= 1 -> out: [B, H, D], q's dtype.

    num_splits: context splits (flash-decoding); None picks them from the shapes and the device."""
    B, H, D = q.shape
    _, BS, HKV, _ = k_cache.shape
    N = block_tables.shape[1]
    assert H % HKV == 0 and k_cache.shape == v_cache.shape and k_cache.shape[3] == D
    assert k_cache.dtype == v_cache.dtype == q.dtype
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.is_contiguous()
    G = H // HKV
    max_context = N * BS  # a bound known on the host: no device sync for context_lens.max()
    BT = min(64, max(16, triton.next_power_of_2(max_context)))
    if num_splits is None:
        num_splits = _num_splits(B * HKV, max_context, q.device)
    split_size = triton.cdiv(triton.cdiv(max_context, num_splits), BT) * BT  # tiles never straddle two splits
    num_splits = triton.cdiv(max_context, split_size)
    out = torch.empty_like(q)
    o_partial = lse_partial = out  # unused placeholders when NUM_SPLITS == 1
    if num_splits > 1:
        o_partial = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        lse_partial = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    BD = max(16, triton.next_power_of_2(D))
    is_interpret = q.device.type != "cuda"  # CPU tensors only run under TRITON_INTERPRET=1
    paged_decode_attention_kernel[(B, HKV, num_splits)](
        q, k_cache, v_cache, out, o_partial, lse_partial, block_tables, context_lens, scale, N, split_size,
        H=H, HKV=HKV, G=G, D=D, BS=BS, BG=max(16, triton.next_power_of_2(G)), BD=BD, BT=BT,
        NUM_SPLITS=num_splits, IS_INTERPRET=is_interpret, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_splits > 1:
        paged_decode_reduce_kernel[(B, H)](o_partial, lse_partial, out, H=H, D=D, NUM_SPLITS=num_splits,
                                           BSPLIT=triton.next_power_of_2(num_splits), BD=BD)
    return out


def _num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, none shorter than MIN_SPLIT_SIZE positions."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(index), num_programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_SIZE))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
