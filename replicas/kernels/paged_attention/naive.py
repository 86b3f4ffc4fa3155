"""Paged attention, the PyTorch reference (CPU path, and the spec for the Triton kernel).

One step's tokens are flattened to T rows (decode rows and prefill chunks of
several sequences together). The KV cache of one layer is a block pool:

    k_cache: [num_blocks, block_size, Hkv, D]     slot = block_id * block_size + offset

The step's sequences are split into at most two groups (decode rows, prefill
chunks) so a decode batch never pads to a prefill chunk's length. Each group is
a padded view, built once per step by the model runner and shared by all layers:

    query_index  [B, Q]        row of each query in the flattened T (padding -> any row)
    query_valid  [B, Q]        False on padding
    mask         [B, 1, Q, L]  key j visible to query i: j <= position(i), j < context_len(b)
    block_tables [B, N] int32  the blocks of sequence b (padding -> block 0), N = ceil(L / block_size)
    context_lens [B] int32     keys of sequence b after this step (the Triton decode kernel reads these two)
    key_ends     Q host ints   keys any query of row i can see, max_b position(b, i) + 1 (prefill tiling)

No Python loop over sequences: per group, one gather of whole blocks (N block copies, not L slot
copies), one attention, one scatter of the valid rows (positions found once per step, not per layer).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

PREFILL_TILE = 64  # query rows per SDPA call in a prefill group (_prefill_attention)


@dataclass(slots=True)
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] int64
    query_valid: torch.Tensor  # [B, Q] bool
    mask: torch.Tensor  # [B, 1, Q, L] bool
    block_tables: torch.Tensor  # [B, N] int32
    context_lens: torch.Tensor  # [B] int32
    key_ends: list[int] | None = None  # [Q]; None: every row may see all L keys
    valid_positions: torch.Tensor = field(init=False)  # [n] int64, the valid queries' positions in [B * Q]
    valid_rows: torch.Tensor = field(init=False)  # [n] int64, their rows in T
    mask_bias: torch.Tensor | None = field(init=False)  # decode (Q = 1): [B, 1, 1, L] float32, 0 visible, -inf not

    def __post_init__(self):
        self.valid_positions = self.query_valid.reshape(-1).nonzero().squeeze(1)
        self.valid_rows = self.query_index.reshape(-1)[self.valid_positions]
        self.mask_bias = None if self.mask.shape[2] != 1 else \
            torch.zeros(self.mask.shape, device=self.mask.device).masked_fill_(~self.mask, float("-inf"))


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; slot_mapping: [T]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          groups: list[AttentionGroup], scale: float) -> torch.Tensor:
    # q: [T, H, D] -> out: [T, H, D]
    out = torch.empty_like(q)
    for g in groups:  # at most two: decode rows, prefill chunks
        naive_group_attention(q, k_cache, v_cache, g, scale, out)
    return out


def naive_group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup,
                          scale: float, out: torch.Tensor) -> None:
    """Writes the rows of one group into out. q, out: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]."""
    num_seqs, num_queries = g.query_index.shape
    num_keys = g.mask.shape[-1]
    q_g = q[g.query_index].transpose(1, 2)  # [B, H, Q, D]
    k_g = gather_blocks(k_cache, g.block_tables)[:, :num_keys].transpose(1, 2)  # [B, Hkv, L, D]
    v_g = gather_blocks(v_cache, g.block_tables)[:, :num_keys].transpose(1, 2)
    if num_queries == 1:
        o_g = _decode_attention(q_g, k_g, v_g, g.mask_bias, scale)
    else:
        o_g = _prefill_attention(q_g, k_g, v_g, g.mask, g.key_ends, scale)
    o_g = o_g.transpose(1, 2).reshape(num_seqs * num_queries, *q.shape[1:])  # [B * Q, H, D]
    out.index_copy_(0, g.valid_rows, o_g if num_queries == 1 else o_g.index_select(0, g.valid_positions))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, N] -> [B, N * block_size, Hkv, D]"""
    num_seqs, num_blocks = block_tables.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(num_seqs, num_blocks * cache.shape[1],
                                                                *cache.shape[2:])


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       key_ends: list[int] | None, scale: float) -> torch.Tensor:
    """SDPA over tiles of PREFILL_TILE query rows, each over only the keys its rows can see: the CPU flash
    kernel does not skip masked-out key blocks, so a causal chunk computed whole pays for its upper triangle
    (512 x 512 causal: 7.1 -> 5.1 ms per layer in tiles of 64; same values).
    q: [B, H, Q, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Q, L] -> [B, H, Q, D]"""
    gqa = q.shape[1] != k.shape[1]
    num_queries = q.shape[2]
    if key_ends is None or num_queries <= PREFILL_TILE:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    tiles = []
    for start in range(0, num_queries, PREFILL_TILE):
        stop = min(num_queries, start + PREFILL_TILE)
        end = max(key_ends[start:stop])  # the tile's rows see keys [0, end)
        tiles.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :end], v[:, :, :end],
                                                    attn_mask=mask[:, :, start:stop, :end], scale=scale,
                                                    enable_gqa=gqa))
    return torch.cat(tiles, dim=2)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls: on CPU several times faster than SDPA in bf16.
    q: [B, H, 1, D]; k, v: [B, Hkv, L, D]; mask_bias: [B, 1, 1, L] -> [B, H, 1, D]"""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query heads grouped by KV head
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).add_(mask_bias)  # [B, Hkv, G, L]
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


def naive_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                           scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The spec of the native CPU kernel (cpu_attention.cpp): one step's varlen batch straight from the block
    tables. A plain loop over sequences, float32 math, an explicit mask.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s + 1] (q_len of them) and has seq_lens[s]
    keys after this step (this step's already stored). Its query i sits at position seq_lens[s] - q_len + i and
    sees key j where j <= position and, when sliding_window > 0, position - j < sliding_window (transformers'
    convention). softcap > 0: scores = softcap * tanh(scores / softcap) after scaling (Gemma 2).
    q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; query_start_loc: [S + 1] int32;
    seq_lens: [S] int32; block_table: [S, max_blocks] int32 -> out: [T, H, D] in q's dtype (rows of no
    sequence left as they come from torch.empty_like)"""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, num_keys in enumerate(seq_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        if first == last:
            continue
        keys = torch.arange(num_keys, device=q.device)  # [L]
        slots = block_table[s, keys // block_size].long() * block_size + keys % block_size
        k = k_flat[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_flat[slots].float().repeat_interleave(group, dim=1)
        positions = torch.arange(num_keys - (last - first), num_keys, device=q.device)  # [Q]
        scores = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * scale  # [H, Q, L]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        visible = keys[None, :] <= positions[:, None]  # [Q, L]
        if sliding_window > 0:
            visible &= positions[:, None] - keys[None, :] < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
