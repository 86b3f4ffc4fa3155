"""Sampler: logits of the sampling rows -> one token id per row, and logprobs for the rows that ask.

0. Rows whose structured-output grammar is active get its token bitmask: disallowed logits to -inf, in
   place (grammar.py). Skipped, at the cost of one counter check, while no request has a grammar.
1. A LogitsPlan is built on the host for the rows that ask for a logits processor (penalties,
   logit_bias, min_tokens, min_p); a batch where none asks takes the plain path with no extra work.
2. The plan is applied to a float32 copy of those rows (processors.py, vLLM's order). A grammar row
   the processors left empty (min_tokens banning the grammar's only way on: its end) keeps the mask alone.
3. Greedy rows (temperature 0) take the argmax of the processed logits.
4. The other rows are divided by their temperature,
5. cut to their top_k, then to their top_p (nucleus, smallest set reaching p),
6. softmaxed, and drawn: a row with a seed draws from its own (CPU) generator,
   so its output does not depend on what else is in the batch or the device.
7. Rows with logprobs get the drawn token's logprob and their top alternatives, from the processed
   logits of step 2 (before temperature; logprobs.py), so they see the grammar's mask.
"""

from dataclasses import dataclass

import torch

from core.messages import RequestError
from replicas.sampling.batch import SamplingRow
from replicas.sampling.grammar import GrammarManager, grammar_end_wins
from replicas.sampling.logprobs import PositionLogprobs, compute_logprobs
from replicas.sampling.processors import apply_logits_plan, build_logits_plan


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[PositionLogprobs | None]  # one per row; None where the request did not ask
    errors: dict[int, RequestError]  # rows that could not be drawn for (fail_empty_rows): their requests fail


class Sampler:
    def __init__(self, grammars: GrammarManager | None = None):
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, batch: list[SamplingRow]) -> SamplerOutput:
        # logits: [R, vocab] float32, row r belongs to batch[r]
        masked_rows = self.grammars.apply(logits, batch) if self.grammars and self.grammars.num_live else []
        plan = build_logits_plan(batch, logits.shape[-1], logits.device)
        processed = apply_logits_plan(logits, plan)  # [R, vocab]; a copy when a plan applies
        if masked_rows and plan is not None:
            processed = grammar_end_wins(processed, logits, masked_rows)
        logits = processed
        errors = fail_empty_rows(logits, batch, masked_rows) if masked_rows else {}
        token_ids = logits.argmax(dim=-1).cpu()  # [R]
        rows = [r for r, row in enumerate(batch) if not row.sampling.is_greedy]
        if rows:
            probs = self._probs(logits[rows], [batch[r] for r in rows]).cpu()  # [len(rows), vocab]
            for i, r in enumerate(rows):
                token_ids[r] = torch.multinomial(probs[i], 1, generator=batch[r].generator)[0]
        return SamplerOutput(token_ids.tolist(), self._logprobs(logits, token_ids, batch), errors)

    def _probs(self, logits: torch.Tensor, batch: list[SamplingRow]) -> torch.Tensor:
        temperature = torch.tensor([row.sampling.temperature for row in batch], dtype=logits.dtype,
                                   device=logits.device)
        logits = logits / temperature[:, None]
        top_k = [row.sampling.top_k for row in batch]
        top_p = [row.sampling.top_p for row in batch]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)

    def _logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                  batch: list[SamplingRow]) -> list[PositionLogprobs | None]:
        out: list[PositionLogprobs | None] = [None] * len(batch)
        rows = [r for r, row in enumerate(batch) if row.sampling.logprobs is not None]
        if rows:
            entries = compute_logprobs(logits[rows], token_ids[rows], [batch[r].sampling.logprobs for r in rows])
            for r, entry in zip(rows, entries):
                out[r] = entry
        return out


def fail_empty_rows(logits: torch.Tensor, batch: list[SamplingRow], rows: list[int]) -> dict[int, RequestError]:
    """A grammar row with no finite logit (no token of this vocabulary can continue the grammar: a choice of
    "\x04") cannot be drawn from: its request fails alone (a 400 naming its field, at postprocess) and the row
    gets zeros, so the batch samples on. logits: [R, V], modified in place. -> {row: its error}"""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    empty = index[~torch.isfinite(logits.index_select(0, index)).any(dim=-1)].tolist()
    errors = {}
    for r in empty:
        spec = batch[r].sampling.structured
        errors[r] = RequestError(f"{spec.param}: no token of this model's vocabulary can continue the "
                                 "structured output here", param=spec.param)
        logits[r] = 0.0
    return errors


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) what falls outside each row's top_k and top_p; k <= 0 and p >= 1 are off.

    When every row has a top_k, only the largest k of them are ranked (topk), not the whole
    vocabulary: a full sort of 8 rows x 49152 logits costs ~45 ms per step on 2 CPU cores."""
    vocab = logits.shape[-1]
    device = logits.device
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]  # a top_k past the vocabulary is off
    width = max(ks)
    if width < vocab:
        ranked, ranked_idx = logits.topk(width, dim=-1)  # [R, width], descending
    else:
        ranked, ranked_idx = logits.sort(dim=-1, descending=True)  # [R, vocab]
    k = torch.tensor(ks, device=device)
    drop = torch.arange(width, device=device)[None, :] >= k[:, None]  # beyond the k-th
    ranked = ranked.masked_fill(drop, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = ranked.softmax(dim=-1)
        p = torch.tensor(top_p, dtype=probs.dtype, device=device)
        # Drop a token when the tokens before it already reach p; the first one always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= p[:, None]
        drop[:, 0] = False  # also when p rounds to 0 in the logits' dtype (top_p 5e-324 is 0.0 in float32)
        ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, ranked_idx, ranked)
