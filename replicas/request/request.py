"""Request: one sequence's state inside the engine.

There is no prefill or decode phase: a request has `num_tokens` (prompt +
generated) and `num_computed_tokens` (those whose KV is in the cache); each step
computes some of the difference, and a token is sampled when the step reaches
the end.
"""

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.messages import RequestError, SamplingParams
from replicas.sampling.logprobs import PositionLogprobs

if TYPE_CHECKING:
    from replicas.request.images import PromptImage
    from replicas.sampling.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: the request's, or the rest of the context
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache, set at first admission
    num_retained_tokens: int = 0  # prompt tokens that came from a retained conversation
    retention: str = "off"  # which path the prompt took (replicas/engine/retention.py)
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # hybrid models: the recurrent-state slot this sequence owns while running
    checkpoint_positions: set[int] = field(default_factory=set)  # hybrid: save the state after these many tokens
    chunk_at_checkpoints: bool = True  # hybrid: prefill chunks end on them (False: the step snapshots them inside)
    last_hidden: torch.Tensor | None = None  # hybrid: final hidden row of the last token fed forward
    restored_hidden: torch.Tensor | None = None  # hybrid: a whole-prompt checkpoint's row, to sample from
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks of token_ids
    num_registered_blocks: int = 0  # leading blocks whose hashes are registered in the pool
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    # With prompt_logprobs: one entry per prompt token 1.., collected across prefill chunks.
    collected_prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    grammar: "GrammarState | None" = None  # structured output: its matcher (replicas/sampling/grammar.py)
    error: RequestError | None = None  # why the request failed mid-generation (its stream gets this error)
    images: "list[PromptImage]" = field(default_factory=list)  # its images' spans (replicas/request/images.py)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def tokens_to_next_checkpoint(self, start: int | None = None) -> int:
        """How far a chunk from `start` (default: the computed tokens) may run so it ends on the next
        checkpoint position; no limit without one."""
        start = self.num_computed_tokens if start is None else start
        if not self.chunk_at_checkpoints:
            return 1 << 30
        return min((p - start for p in self.checkpoint_positions if p > start), default=1 << 30)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def needs_prompt_logits(self) -> bool:
        # Logits at every prompt position: computed from token 0, so the prefix cache is bypassed until done.
        return (self.sampling.prompt_logprobs is not None
                and len(self.collected_prompt_logprobs) < self.num_prompt_tokens - 1)

    def is_stop_token(self, token_id: int) -> bool:
        if token_id in self.sampling.stop_token_ids:
            return True
        return not self.sampling.ignore_eos and token_id in self.eos_token_ids
