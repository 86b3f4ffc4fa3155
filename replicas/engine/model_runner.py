"""ModelRunner: executes one scheduled step. It decides nothing.

Builds the step's ForwardBatch (flattened tokens, positions, slot mapping,
attention groups), runs the model once over it, computes logits only for the
rows that sample, and samples them. Requests with prompt_logprobs also get
logits at their prompt rows of the step (chunk by chunk), scored against the
next prompt token.

    scheduled:  A(prefill chunk, 5 tokens from position 0)  B(decode)  C(decode)
    input_ids:  a0 a1 a2 a3 a4 | b7 | c3                       T = 7
    groups:     decode [B, C] (Q = 1)   prefill [A] (Q = 5)
    A with prompt_logprobs, prompt of 9:  rows a0..a4 score tokens a1..a5
"""

import logging
from dataclasses import dataclass, field

import torch

from replicas.engine.batch_builder import BatchBuilder, sampling_rows
from replicas.engine.compiled_step import CompiledForward, compile_support, warm_up_scheduled
from replicas.engine.phases import phase
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention import uses_native_attention
from replicas.models.forward_batch import ForwardBatch
from replicas.models.gated_deltanet import LinearLayerState, LinearStateBatch, make_linear_state_batch
from replicas.sampling.logprobs import PositionLogprobs, compute_logprobs
from replicas.sampling.sampler import Sampler

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log

# Prompt rows turned into logprobs at a time: bounds the [rows, vocab] float32 logits they need.
PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class ModelRunnerOutput:
    token_ids: list[int]  # one per sampling row, in scheduled order
    logprobs: list[PositionLogprobs | None]  # one per sampling row; None where not asked
    prompt_logprobs: dict[str, list[PositionLogprobs]]  # request id -> this step's prompt positions, in order
    last_hidden: torch.Tensor | None = None  # hybrid models: [S, hidden], each item's last row (for checkpoints)
    snapshots: list["StepSnapshot"] = field(default_factory=list)  # hybrid: states taken inside this step's chunks


@dataclass(slots=True)
class StepSnapshot:
    """A hybrid sequence's state after `num_tokens` of its tokens, copied out inside a step (a checkpoint
    position inside a prefill chunk): what its slot would hold, had the step ended there."""
    item: int  # the scheduled item
    num_tokens: int
    conv_states: list[torch.Tensor]  # per linear layer: [conv_dim, W - 1]
    recurrent_states: list[torch.Tensor]  # per linear layer: [HV, K, V] float32
    hidden: torch.Tensor  # [hidden]: the final hidden row of its last token


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, linear_states: list[LinearLayerState] | None = None, grammars=None,
                 vision=None, compile_step: bool = False):
        self.model = model
        # The forward the steps call: one compiled graph (replicas/engine/compiled_step.py) or the model itself.
        off = compile_support(model, device) if compile_step else "engine.compile_step is false"
        self.forward = CompiledForward(model) if off is None else model
        if off is not None and compile_step:
            logger.info("compiled step off: %s", off)
        self.kv_caches = kv_caches
        self.linear_states = linear_states  # hybrid models: per linear layer, state tensors indexed by slot
        # hybrid models on the native recurrent ops: checkpoint positions inside a chunk are snapshots
        self.snapshot_checkpoints = False
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(grammars)
        self.vision = vision  # replicas/engine/vision_encoder.py VisionEncoder, for a model that takes images
        # The PyTorch attention path's padded groups are built only where no native attention op runs.
        self.batch_builder = BatchBuilder(block_size, device, build_groups=not uses_native_attention(model, device),
                                          batch_invariant=bool(getattr(model, "batch_invariant", False)))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the step's graph now rather than at the first request: a one-token forward whose KV goes to
        slot 0 of block 0 (every block is free at start-up; its owner writes a slot before reading it)."""
        if isinstance(self.forward, CompiledForward):
            scheduled = warm_up_scheduled([0])
            batch = self.batch_builder.build(scheduled)
            linear_state = [] if self.linear_states is None else [self._linear_state(scheduled, batch)[0]]
            self.forward(batch.input_ids, batch.positions, self.kv_caches, batch, *linear_state)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """One forward over the step; samples one token per sampling row, in scheduled order."""
        with phase("build"):
            batch = self.prepare(scheduled)
        with phase("forward"):
            if self.linear_states is None:
                hidden = self.forward(batch.input_ids, batch.positions, self.kv_caches, batch)  # [T, hidden]
                last_hidden, snapshots = None, []
                sample_hidden = hidden[batch.logits_indices]  # [R, hidden]
            else:
                linear_state, wanted = self._linear_state(scheduled, batch)
                hidden = self.forward(batch.input_ids, batch.positions, self.kv_caches, batch,
                                      linear_state) if batch.input_ids.numel() else None
                last_hidden = self._last_hidden(hidden, batch, scheduled)  # [S, hidden]
                snapshots = self._snapshots(linear_state, wanted, hidden)
                sample_hidden = last_hidden[[i for i, item in enumerate(scheduled) if item.samples]]
            prompt_logprobs = self._prompt_logprobs(hidden, scheduled) if hidden is not None else {}
            if sample_hidden.shape[0] == 0:
                return ModelRunnerOutput([], [], prompt_logprobs, last_hidden, snapshots)
            logits = self.model.compute_logits(sample_hidden)  # [R, vocab] float32
        with phase("sample"):
            sampling_requests = [item.request for item in scheduled if item.samples]
            sampled = self.sampler(logits, sampling_rows(sampling_requests))
            for row, error in sampled.errors.items():
                sampling_requests[row].error = error  # the scheduler ends it alone (Scheduler.postprocess)
        return ModelRunnerOutput(sampled.token_ids, sampled.logprobs, prompt_logprobs, last_hidden, snapshots)

    @staticmethod
    def _last_hidden(hidden: torch.Tensor | None, batch, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Each item's last row; an item with no token to compute (a whole-prompt checkpoint hit) takes
        the hidden row its checkpoint saved. -> [S, hidden]"""
        ends = batch.cu_seqlens[1:].tolist()
        rows = [hidden[end - 1] if item.num_tokens else item.request.restored_hidden
                for item, end in zip(scheduled, ends)]
        return torch.stack(rows)

    def _linear_state(self, scheduled: list[ScheduledRequest], batch) -> tuple[LinearStateBatch, list]:
        """Each sequence's state slot; a sequence with nothing computed yet starts from zeros. With snapshot
        checkpoints, the rows after which the step copies states out: -> (the batch, [(item, num_tokens)])."""
        slots = torch.tensor([item.request.state_slot for item in scheduled], dtype=torch.int64, device=self.device)
        has_initial = torch.tensor([item.request.num_computed_tokens > 0 for item in scheduled], device=self.device)
        rows, wanted = [], []
        if self.snapshot_checkpoints:
            starts = batch.cu_seqlens.tolist()
            for i, item in enumerate(scheduled):
                done = item.request.num_computed_tokens
                for position in sorted(p for p in item.request.checkpoint_positions
                                       if done < p < done + item.num_tokens):
                    rows.append(starts[i] + position - done - 1)
                    wanted.append((i, position))
        return make_linear_state_batch(self.linear_states, batch.cu_seqlens, slots, has_initial, rows), wanted

    @staticmethod
    def _snapshots(linear_state: LinearStateBatch, wanted: list, hidden: torch.Tensor | None) -> list[StepSnapshot]:
        return [StepSnapshot(item, num_tokens, [layer.conv_state[j] for layer in linear_state.snapshots],
                             [layer.recurrent_state[j] for layer in linear_state.snapshots],
                             hidden[linear_state.snapshot_rows[j]].clone())
                for j, (item, num_tokens) in enumerate(wanted)]

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         scheduled: list[ScheduledRequest]) -> dict[str, list[PositionLogprobs]]:
        """Logprobs (of the raw logits: no processor applies to a prompt) of the next prompt token at each
        prompt row of the requests that need them. hidden: [T, hidden]."""
        rows, targets, owners = [], [], []  # flat row, the prompt token it scores, its request
        offset = 0
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            if request.needs_prompt_logits:
                # Position p scores prompt token p + 1; positions already collected (before a preemption) are skipped.
                first = max(start, len(request.collected_prompt_logprobs))
                last = min(start + item.num_tokens, request.num_prompt_tokens - 1)
                for p in range(first, last):
                    rows.append(offset + p - start)
                    targets.append(request.prompt_token_ids[p + 1])
                    owners.append(request)
            offset += item.num_tokens
        out: dict[str, list[PositionLogprobs]] = {}
        for i in range(0, len(rows), PROMPT_LOGITS_ROWS):
            idx = torch.tensor(rows[i:i + PROMPT_LOGITS_ROWS], dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[idx])  # [n, vocab] float32
            part = owners[i:i + PROMPT_LOGITS_ROWS]
            entries = compute_logprobs(logits, torch.tensor(targets[i:i + PROMPT_LOGITS_ROWS]),
                                       [req.sampling.prompt_logprobs for req in part])
            for req, entry in zip(part, entries):
                out.setdefault(req.request_id, []).append(entry)
        return out

    def prepare(self, scheduled: list[ScheduledRequest]) -> ForwardBatch:
        batch = self.batch_builder.build(scheduled)
        if batch.mrope_positions is not None:
            batch.image_embeds = self._image_embeds(scheduled)
        return batch

    def _image_embeds(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image tokens: (rows [K], their vision features [K, hidden]); the tower runs only for
        images whose tokens this step computes and whose features are not cached."""
        rows, features, offset = [], [], 0
        for item in scheduled:
            start = item.request.num_computed_tokens
            end = start + item.num_tokens
            for image in item.request.images:
                lo, hi = max(image.span.start, start), min(image.span.end, end)
                if lo < hi:
                    rows.append(torch.arange(offset + lo - start, offset + hi - start))
                    features.append(self.vision.features(image)[lo - image.span.start:hi - image.span.start])
            offset += item.num_tokens
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(features).to(self.device)
