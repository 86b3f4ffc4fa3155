"""ModelRunner: executes one scheduled step. It decides nothing.

Builds the step's ForwardBatch (flattened tokens, positions, slot mapping,
attention groups), runs the model once over it, computes logits only for the
rows that sample, and samples them.

    scheduled:  A(prefill chunk, 5 tokens from position 0)  B(decode)  C(decode)
    input_ids:  a0 a1 a2 a3 a4 | b7 | c3                       T = 7
    groups:     decode [B, C] (Q = 1)   prefill [A] (Q = 5)
"""

import torch

from replicas.engine.forward_batch import ForwardBatch
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import AttentionGroup
from replicas.sampling.sampler import Sampler


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """One forward over the step; returns one sampled token id per sampling row, in scheduled order."""
        batch = self.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch)  # [T, hidden]
        if batch.logits_indices.numel() == 0:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [R, vocab] float32
        sampling_requests = [item.request for item in scheduled if item.samples]
        return self.sampler(logits, sampling_requests)

    def prepare(self, scheduled: list[ScheduledRequest]) -> ForwardBatch:
        input_ids, positions, slot_mapping, cu_seqlens, logits_indices = [], [], [], [0], []
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            span = range(start, start + item.num_tokens)
            input_ids.extend(request.token_ids[start:start + item.num_tokens])
            positions.extend(span)
            slot_mapping.extend(self._slot(request.block_table, pos) for pos in span)
            cu_seqlens.append(cu_seqlens[-1] + item.num_tokens)
            if item.samples:
                logits_indices.append(cu_seqlens[-1] - 1)
        decode = [i for i, item in enumerate(scheduled) if item.num_tokens == 1]
        prefill = [i for i, item in enumerate(scheduled) if item.num_tokens > 1]
        groups = [self._group(scheduled, cu_seqlens, idx) for idx in (decode, prefill) if idx]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return ForwardBatch(as_tensor(input_ids), as_tensor(positions), as_tensor(slot_mapping),
                            as_tensor(cu_seqlens), groups, as_tensor(logits_indices))

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _group(self, scheduled: list[ScheduledRequest], cu_seqlens: list[int], members: list[int]) -> AttentionGroup:
        items = [scheduled[i] for i in members]
        num_queries = max(item.num_tokens for item in items)
        context_lens = [item.request.num_computed_tokens + item.num_tokens for item in items]
        max_context = max(context_lens)
        num_blocks = -(-max_context // self.block_size)
        block_tables = [item.request.block_table[:num_blocks] for item in items]
        block_tables = [bt + [0] * (num_blocks - len(bt)) for bt in block_tables]
        query_index, query_pos = [], []
        for i, item in zip(members, items):
            pad = num_queries - item.num_tokens
            query_index.append(list(range(cu_seqlens[i], cu_seqlens[i + 1])) + [cu_seqlens[i]] * pad)
            first = item.request.num_computed_tokens
            query_pos.append(list(range(first, first + item.num_tokens)) + [0] * pad)
        dev = self.device
        query_index = torch.tensor(query_index, dtype=torch.int64, device=dev)  # [B, Q]
        query_pos = torch.tensor(query_pos, dtype=torch.int64, device=dev)  # [B, Q]
        num_valid = torch.tensor([item.num_tokens for item in items], device=dev)  # [B]
        query_valid = torch.arange(num_queries, device=dev)[None, :] < num_valid[:, None]
        key_pos = torch.arange(max_context, device=dev)  # [L]
        tables = torch.tensor(block_tables, dtype=torch.int64, device=dev)  # [B, num_blocks]
        key_slots = tables[:, key_pos // self.block_size] * self.block_size + key_pos % self.block_size  # [B, L]
        context = torch.tensor(context_lens, device=dev)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context[:, None, None])
        return AttentionGroup(query_index, query_valid, key_slots, mask.unsqueeze(1))
