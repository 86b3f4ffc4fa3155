"""Paged attention, the PyTorch reference (CPU path, and the spec for the Triton kernel).

One step's tokens are flattened to T rows (decode rows and prefill chunks of
several sequences together). The KV cache of one layer is a block pool:

    k_cache: [num_blocks, block_size, Hkv, D]     slot = block_id * block_size + offset

The step's sequences are split into at most two groups (decode rows, prefill
chunks) so a decode batch never pads to a prefill chunk's length. Each group is
a padded view, built once per step by the model runner and shared by all layers:

    query_index [B, Q]   row of each query in the flattened T (padding -> any row)
    query_valid [B, Q]   False on padding
    key_slots   [B, L]   cache slot of key position j of sequence b (padding -> slot 0)
    mask        [B, 1, Q, L]  key j visible to query i: j <= position(i), j < context_len(b)
    block_tables [B, N] int32 the blocks of sequence b (padding -> block 0), N = ceil(L / block_size)
    context_lens [B] int32    keys of sequence b after this step (the Triton decode kernel reads these two)

No Python loop over sequences: one gather, one SDPA and one scatter per group.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] int64
    query_valid: torch.Tensor  # [B, Q] bool
    key_slots: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, 1, Q, L] bool
    block_tables: torch.Tensor  # [B, N] int32
    context_lens: torch.Tensor  # [B] int32


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; slot_mapping: [T]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          groups: list[AttentionGroup], scale: float) -> torch.Tensor:
    # q: [T, H, D] -> out: [T, H, D]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in groups:  # at most two: decode rows, prefill chunks
        naive_group_attention(q, k_flat, v_flat, g, scale, out)
    return out


def naive_group_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, g: AttentionGroup,
                          scale: float, out: torch.Tensor) -> None:
    """Writes the rows of one group into out. q, out: [T, H, D]; k_flat, v_flat: [num_slots, Hkv, D]."""
    q_g = q[g.query_index].transpose(1, 2)  # [B, H, Q, D]
    k_g = k_flat[g.key_slots].transpose(1, 2)  # [B, Hkv, L, D]
    v_g = v_flat[g.key_slots].transpose(1, 2)
    if q_g.shape[2] == 1:
        o_g = _decode_attention(q_g, k_g, v_g, g.mask, scale)
    else:
        o_g = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=g.mask, scale=scale,
                                             enable_gqa=q_g.shape[1] != k_g.shape[1])
    o_g = o_g.transpose(1, 2)  # [B, Q, H, D]
    out[g.query_index[g.query_valid]] = o_g[g.query_valid]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls: on CPU several times faster than SDPA in bf16.
    q: [B, H, 1, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, 1, L] -> [B, H, 1, D]"""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query heads grouped by KV head
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, 1, head_dim)


def naive_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The spec of the Triton decode kernel: one query per sequence at position context_len - 1, so it sees keys
    0..context_len-1 through its block table. A plain loop over sequences, float32 math.
    q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, N] int32;
    context_lens: [B] int32 -> out: [B, H, D] in q's dtype"""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for b, context_len in enumerate(context_lens.tolist()):
        positions = torch.arange(context_len, device=q.device)  # [L]
        slots = block_tables[b, positions // block_size].long() * block_size + positions % block_size
        k = k_flat[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v_flat[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [H, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
