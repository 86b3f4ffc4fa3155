"""Logits processors: penalties, logit_bias, min_tokens and min_p, on a float32 copy of the rows that ask.

    plan = build_logits_plan(batch, vocab_size, device)   host side, once per step; None: no row asks
    logits = apply_logits_plan(logits, plan)                 the plan's rows processed, the others untouched

The plan applies, in vLLM's order:
1. repetition_penalty over prompt + generated ids (HF): a seen token's logit / p if > 0, * p otherwise;
2. presence_penalty over generated ids: - penalty where the count > 0;
3. frequency_penalty over generated ids: - penalty * count;
4. logit_bias: + bias, clamped to [-100, 100];
5. min_tokens: the EOS ids (unless ignore_eos) and stop_token_ids to -inf while fewer than min_tokens are generated;
6. min_p: tokens whose probability (softmax of the logits so far) is below min_p * the top probability to -inf,
   compared in logit space: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p).
Temperature, top_k and top_p follow in the sampler.

The penalties work on the history positions only, never on the whole vocabulary: gather the logits at the
ids, penalise, scatter back. A token seen twice is written twice with the same value, so duplicates are
harmless; padding repeats a row's first id for the same reason.

    output_ids  [5, 9, 5, V, V]   (V = vocab_size: padding)
    index       [5, 9, 5, 5, 5]   counts (among the real ids) [2, 1, 2, 2, 2]
    x[5] -= presence + 2 * frequency (written 4 times, same value);  x[9] -= presence + frequency

A drawn token is history only if it is kept: counts and seen sets come from the request's token ids
(what the scheduler appended), never from a draw, and the plan keeps nothing between steps. A draw that
is thrown away therefore never penalises the next one.
"""

from dataclasses import dataclass

import torch

from replicas.sampling.batch import SamplingRow

MAX_LOGIT_BIAS = 100.0


def asks_for_processing(request: SamplingRow) -> bool:
    """Whether the request's row needs a processor this step (min_tokens only while it still binds)."""
    s = request.sampling
    return (s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
            or bool(s.logit_bias) or s.min_p > 0.0 or request.num_output_tokens < s.min_tokens)


@dataclass(slots=True)
class LogitsPlan:
    """What to do to the rows that ask; every tensor has one row per entry of `rows`. None: the step is off."""

    rows: torch.Tensor  # [P] int64, batch rows that ask, ascending
    vocab_size: int
    # Histories are padded with `vocab_size`; a row without the penalty has an empty one.
    repetition_penalty: torch.Tensor | None = None  # [P] float32, 1 for rows without it
    seen_ids: torch.Tensor | None = None  # [P, Ls] int64, prompt + generated ids
    presence_penalty: torch.Tensor | None = None  # [P] float32, 0 for rows without it
    frequency_penalty: torch.Tensor | None = None  # [P] float32, 0 for rows without it
    output_ids: torch.Tensor | None = None  # [P, Lo] int64, generated ids
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # ([N] plan row, [N] token id)
    bias_values: torch.Tensor | None = None  # [N] float32
    banned_index: tuple[torch.Tensor, torch.Tensor] | None = None  # ([M] plan row, [M] token id)
    min_p: torch.Tensor | None = None  # [P] float32, 0 for rows without it (log 0 = -inf masks nothing)


def build_logits_plan(batch: list[SamplingRow], vocab_size: int,
                      device: torch.device | str = "cpu") -> LogitsPlan | None:
    """The step's plan for the rows of `batch`; None when no row asks (the sampler's plain path)."""
    rows = [r for r, row in enumerate(batch) if asks_for_processing(row)]
    if not rows:
        return None
    asking = [batch[r] for r in rows]
    params = [row.sampling for row in asking]
    to = lambda xs, dtype: torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    plan = LogitsPlan(to(rows, torch.int64), vocab_size)
    if any(s.repetition_penalty != 1.0 for s in params):
        plan.repetition_penalty = to([s.repetition_penalty for s in params], torch.float32)
        seen = [row.token_ids if row.sampling.repetition_penalty != 1.0 else [] for row in asking]
        plan.seen_ids = to(_padded(seen, vocab_size), torch.int64)
    if any(s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 for s in params):
        plan.presence_penalty = to([s.presence_penalty for s in params], torch.float32)
        plan.frequency_penalty = to([s.frequency_penalty for s in params], torch.float32)
        outputs = [row.output_token_ids if row.sampling.presence_penalty or row.sampling.frequency_penalty else []
                   for row in asking]
        plan.output_ids = to(_padded(outputs, vocab_size), torch.int64)
    bias = [(p, t, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, b)))
            for p, s in enumerate(params) for t, b in s.logit_bias.items()]
    if bias:
        plan.bias_index = (to([p for p, _, _ in bias], torch.int64), to([t for _, t, _ in bias], torch.int64))
        plan.bias_values = to([b for _, _, b in bias], torch.float32)
    banned = [(p, t) for p, row in enumerate(asking) for t in sorted(_min_tokens_banned(row, vocab_size))]
    if banned:
        plan.banned_index = (to([p for p, _ in banned], torch.int64), to([t for _, t in banned], torch.int64))
    if any(s.min_p > 0.0 for s in params):
        plan.min_p = to([s.min_p for s in params], torch.float32)
    return plan


def _padded(histories: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(len(h) for h in histories))
    return [h + [pad] * (width - len(h)) for h in histories]


def _min_tokens_banned(request: SamplingRow, vocab_size: int) -> set[int]:
    s = request.sampling
    if request.num_output_tokens >= s.min_tokens:
        return set()
    banned = set(s.stop_token_ids) | (set() if s.ignore_eos else set(request.eos_token_ids))
    return {t for t in banned if 0 <= t < vocab_size}


def apply_logits_plan(logits: torch.Tensor, plan: LogitsPlan | None) -> torch.Tensor:
    """Processed logits; the input is never modified. logits: [R, vocab] -> [R, vocab] float32."""
    if plan is None:
        return logits
    every_row = plan.rows.numel() == logits.shape[0]  # then rows are 0..R-1
    x = logits.to(torch.float32, copy=True) if every_row else logits[plan.rows].float()  # [P, vocab], a copy
    if plan.repetition_penalty is not None:
        index = _history_index(plan.seen_ids, plan.vocab_size)  # [P, Ls]
        values = x.gather(1, index)
        penalty = plan.repetition_penalty[:, None].clamp_min(1e-6)  # 1e-57 is 0.0 in float32: x / 0 is inf
        x.scatter_(1, index, torch.where(values > 0, values / penalty, values * penalty))
    if plan.output_ids is not None:
        index = _history_index(plan.output_ids, plan.vocab_size)  # [P, Lo]
        counts = _history_counts(plan.output_ids, index)  # [P, Lo]
        penalty = plan.presence_penalty[:, None] * (counts > 0) + plan.frequency_penalty[:, None] * counts
        x.scatter_(1, index, x.gather(1, index) - penalty)
    if plan.bias_index is not None:
        x.index_put_(plan.bias_index, plan.bias_values, accumulate=True)
    if plan.banned_index is not None:
        x.index_put_(plan.banned_index, torch.tensor(float("-inf"), device=x.device))
    if plan.min_p is not None:
        threshold = x.amax(dim=-1, keepdim=True) + plan.min_p[:, None].log()  # [P, 1]
        x = torch.where(x < threshold, float("-inf"), x)
    return x if every_row else logits.float().index_copy(0, plan.rows, x)


def _history_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids: [P, L] padded with vocab_size -> [P, L] with the padding replaced by the row's first id."""
    first = ids[:, :1].clamp(max=vocab_size - 1)  # an empty row points at a token it never counts
    return torch.where(ids < vocab_size, ids, first)


def _history_counts(ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Occurrences of index[p, l] among the real ids of row p: [P, L] float32."""
    ordered = ids.sort(dim=1).values  # padding sorts last and matches no index
    return (torch.searchsorted(ordered, index, right=True) - torch.searchsorted(ordered, index)).float()
