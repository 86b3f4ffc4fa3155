"""BatchBuilder: a step's ForwardBatch, built with numpy into buffers allocated once (nothing per token in
Python, one short loop over the step's sequences).

    scheduled:        A(prefill chunk, 5 tokens from position 0)  B(decode at 7)  C(decode at 3)
    input_ids:        a0 a1 a2 a3 a4 | b7 | c3                       T = 7
    query_start_loc:  0 5 6 7                                        [S + 1] int32
    seq_lens:         5 8 4                                          [S] int32, keys after this step
    block_table:      [S, N] int32, each sequence's blocks, padded with 0
    slot_mapping:     block_table[s, p // block_size] * block_size + p % block_size, per token

The native attention op reads query_start_loc / seq_lens / block_table directly. The PyTorch path (and the
CUDA decode kernel) reads `groups`: decode rows and prefill chunks as padded views with masks, built only
where `build_groups` says so (attention_groups.py).

The tensors are views of the builder's buffers: valid until the next build, i.e. for one step.
"""

import numpy as np
import torch

from replicas.engine.attention_groups import build_groups
from replicas.engine.scheduler import ScheduledRequest
from replicas.models.forward_batch import ForwardBatch
from replicas.models.mrope import image_positions
from replicas.request.request import Request
from replicas.sampling.batch import SamplingRow


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, build_groups: bool, batch_invariant: bool = False):
        self.block_size = block_size
        self.device = device
        self.build_groups = build_groups
        self.batch_invariant = batch_invariant  # the loader put every linear on the fixed-order kernel
        self._allocate(num_tokens=256, num_seqs=16, num_blocks=64)

    def _allocate(self, num_tokens: int, num_seqs: int, num_blocks: int) -> None:
        # Ordinary tensors even when a step (under inference mode) grows them: the compiled step's graph guards
        # on its inputs' dispatch keys, and inference tensors' differ (a recompile at the first larger step).
        with torch.inference_mode(False):
            self.tokens = torch.zeros(3, num_tokens, dtype=torch.int64)  # input_ids, positions, slot_mapping
            self.seqs = torch.zeros(3, num_seqs + 1, dtype=torch.int64)  # cu_seqlens, seq_lens, logits_indices
            self.seqs32 = torch.zeros(2, num_seqs + 1, dtype=torch.int32)  # query_start_loc, seq_lens
            self.block_table = torch.zeros(num_seqs * num_blocks, dtype=torch.int32)  # viewed [S, N] contiguous
        self.max_blocks = num_blocks

    def _ensure(self, num_tokens: int, num_seqs: int, num_blocks: int) -> None:
        if num_tokens > self.tokens.shape[1] or num_seqs >= self.seqs.shape[1] or num_blocks > self.max_blocks:
            self._allocate(max(num_tokens, 2 * self.tokens.shape[1]), max(num_seqs, 2 * (self.seqs.shape[1] - 1)),
                           max(num_blocks, 2 * self.max_blocks))

    def build(self, scheduled: list[ScheduledRequest]) -> ForwardBatch:
        num_seqs = len(scheduled)
        starts = [item.request.num_computed_tokens for item in scheduled]
        counts = [item.num_tokens for item in scheduled]
        ends = [start + count for start, count in zip(starts, counts)]
        num_blocks = -(-max(ends, default=1) // self.block_size)
        num_tokens = sum(counts)
        self._ensure(num_tokens, num_seqs, num_blocks)
        input_ids, positions, slot_mapping = self.tokens.numpy()[:, :num_tokens]  # [T] each
        cu_seqlens, seq_lens, logits_indices = self.seqs.numpy()[:, :num_seqs + 1]
        block_table = self.block_table[:num_seqs * num_blocks].view(num_seqs, num_blocks)
        tables = block_table.numpy()  # [S, N]
        tables.fill(0)
        cu_seqlens[0] = 0
        num_sampling = 0
        for s, (item, start, end) in enumerate(zip(scheduled, starts, ends)):
            request, lo, hi = item.request, int(cu_seqlens[s]), int(cu_seqlens[s]) + end - start
            input_ids[lo:hi] = request.token_ids[start:end]
            used = -(-end // self.block_size)
            tables[s, :used] = request.block_table[:used]
            cu_seqlens[s + 1] = hi
            seq_lens[s] = end
            if item.samples:
                logits_indices[num_sampling] = hi - 1
                num_sampling += 1
        rows = np.repeat(np.arange(num_seqs), counts)  # [T] each token's sequence
        np.subtract(np.arange(num_tokens), np.repeat(cu_seqlens[:num_seqs] - starts, counts), out=positions)
        np.add(tables[rows, positions // self.block_size].astype(np.int64) * self.block_size,
               positions % self.block_size, out=slot_mapping)
        mrope = self._mrope_positions(scheduled, starts, ends, cu_seqlens, positions)
        self.seqs32.numpy()[:, :num_seqs + 1] = self.seqs.numpy()[:2, :num_seqs + 1]
        to = (lambda t: t) if self.device.type == "cpu" else (lambda t: t.to(self.device, non_blocking=True))
        groups = build_groups(scheduled, cu_seqlens.tolist(), self.block_size, self.device) \
            if self.build_groups else None
        return ForwardBatch(
            input_ids=to(self.tokens[0, :num_tokens]), positions=to(self.tokens[1, :num_tokens]),
            slot_mapping=to(self.tokens[2, :num_tokens]), cu_seqlens=to(self.seqs[0, :num_seqs + 1]),
            groups=groups, logits_indices=to(self.seqs[2, :num_sampling]),
            query_start_loc=to(self.seqs32[0, :num_seqs + 1]), seq_lens=to(self.seqs32[1, :num_seqs]),
            block_table=to(block_table), mrope_positions=to(mrope) if mrope is not None else None,
            batch_invariant=self.batch_invariant)

    @staticmethod
    def _mrope_positions(scheduled, starts, ends, cu_seqlens, positions) -> torch.Tensor | None:
        """[3, T] (t, h, w) positions when a scheduled sequence has images (replicas/models/mrope.py): its rows
        follow its images' grids; every other row has its position on all three axes. None: no images."""
        if not any(item.request.images for item in scheduled):
            return None
        mrope = np.repeat(positions[None], 3, axis=0)  # [3, T]
        for s, (item, start, end) in enumerate(zip(scheduled, starts, ends)):
            if item.request.images:
                lo = int(cu_seqlens[s])
                mrope[:, lo:lo + end - start] = image_positions([im.span for im in item.request.images], start, end)
        return torch.from_numpy(mrope)


def sampling_rows(requests: list[Request]) -> list[SamplingRow]:
    """The sampler's batch: one row per request that samples this step, in row order."""
    return [SamplingRow(r.sampling, r.token_ids, r.num_prompt_tokens, r.eos_token_ids, r.generator, r.grammar)
            for r in requests]
