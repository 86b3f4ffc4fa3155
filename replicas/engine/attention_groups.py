"""The PyTorch attention path's view of a step (kernels/paged_attention/naive.py `AttentionGroup`): decode rows
and prefill chunks as two padded groups with masks, so a decode batch never pads to a chunk's length. Built
only where that path runs (no native attention op: CUDA, or a CPU without the native build)."""

import torch

from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import AttentionGroup


def build_groups(scheduled: list[ScheduledRequest], cu_seqlens: list[int], block_size: int,
                 device: torch.device) -> list[AttentionGroup]:
    decode = [i for i, item in enumerate(scheduled) if item.num_tokens == 1]
    prefill = [i for i, item in enumerate(scheduled) if item.num_tokens > 1]
    return [_group(scheduled, cu_seqlens, idx, block_size, device) for idx in (decode, prefill) if idx]


def _group(scheduled: list[ScheduledRequest], cu_seqlens: list[int], members: list[int], block_size: int,
           dev: torch.device) -> AttentionGroup:
    items = [scheduled[i] for i in members]
    num_queries = max(item.num_tokens for item in items)
    context_lens = [item.request.num_computed_tokens + item.num_tokens for item in items]
    max_context = max(context_lens)
    num_blocks = -(-max_context // block_size)
    block_tables = [item.request.block_table[:num_blocks] for item in items]
    block_tables = [bt + [0] * (num_blocks - len(bt)) for bt in block_tables]
    query_index, query_pos = [], []
    key_ends = [0] * num_queries  # row i: keys any sequence's query i sees
    for i, item in zip(members, items):
        pad = num_queries - item.num_tokens
        query_index.append(list(range(cu_seqlens[i], cu_seqlens[i + 1])) + [cu_seqlens[i]] * pad)
        first = item.request.num_computed_tokens
        query_pos.append(list(range(first, first + item.num_tokens)) + [0] * pad)
        sees = range(first + 1, first + item.num_tokens + 1)  # query i at position first + i
        key_ends[:item.num_tokens] = map(max, key_ends[:item.num_tokens], sees)
    query_index = torch.tensor(query_index, dtype=torch.int64, device=dev)  # [B, Q]
    query_pos = torch.tensor(query_pos, dtype=torch.int64, device=dev)  # [B, Q]
    num_valid = torch.tensor([item.num_tokens for item in items], device=dev)  # [B]
    query_valid = torch.arange(num_queries, device=dev)[None, :] < num_valid[:, None]
    key_pos = torch.arange(max_context, device=dev)  # [L]
    tables = torch.tensor(block_tables, dtype=torch.int32, device=dev)  # [B, num_blocks]
    context = torch.tensor(context_lens, dtype=torch.int32, device=dev)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context[:, None, None])
    return AttentionGroup(query_index, query_valid, mask.unsqueeze(1), tables, context, key_ends)
