"""Logprobs: the chosen token's log-probability and the most likely alternatives, per row.

A logprob is logit - logsumexp over the WHOLE vocabulary of the logits it is given (the sampler gives the
processed logits: after the logits processors, before temperature; the runner gives raw logits at prompt
positions), in float32. It is not renormalised over the entries listed, so they do not sum to 1.
Tokens at -inf (masked by min_tokens, min_p) are never listed as alternatives.
"""

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PositionLogprobs:
    """One position, numbers only (the engine adds the token texts)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), most likely first


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[PositionLogprobs]:
    """logits: [R, vocab], token_ids: [R] (the token at each row), num_top[r]: alternatives for row r."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = logprobs.gather(1, token_ids.to(logprobs.device, torch.int64)[:, None])[:, 0].tolist()  # [R]
    k = min(max(num_top, default=0), logprobs.shape[-1])
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [R, k], sorted, most likely first
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for r, token_id in enumerate(token_ids.tolist()):
        top = []
        if k > 0:
            top = [(t, v) for t, v in zip(top_ids[r][:num_top[r]], top_values[r][:num_top[r]])
                   if v != float("-inf")]
        out.append(PositionLogprobs(token_id, chosen[r], top))
    return out
