"""SamplingRow: what the sampler reads of one sampling row. The batch builder (engine/batch_builder.py)
makes one per request that samples this step, in row order; the sampler never sees a Request.

    logits  [R, vocab]   row r  <->  rows[r]: its params, history, stop ids, generator, grammar

`token_ids` is the request's own list (prompt + generated, what the scheduler appended), read during the
step and never kept: a draw that is thrown away is not in it, so it counts in no penalty window.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from core.messages import SamplingParams

if TYPE_CHECKING:
    from replicas.sampling.grammar import GrammarState


@dataclass(slots=True)
class SamplingRow:
    sampling: SamplingParams
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None  # a seeded request's own
    grammar: "GrammarState | None" = None  # structured output: its matcher (grammar.py)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
