"""Sampler: logits of the sampling rows -> one token id per row.

1. Greedy rows (temperature 0) take the argmax of the raw logits.
2. The other rows are divided by their temperature,
3. cut to their top_k, then to their top_p (nucleus, smallest set reaching p),
4. softmaxed, and drawn: a row with a seed draws from its own (CPU) generator,
   so its output does not depend on what else is in the batch or the device.
Logits processors (penalties, logit_bias, min_p) join in front of step 2 later.
"""

import torch

from replicas.engine.request import Request


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        # logits: [R, vocab] float32, row r belongs to requests[r]
        token_ids = logits.argmax(dim=-1).cpu()  # [R]
        rows = [r for r, req in enumerate(requests) if not req.sampling.is_greedy]
        if rows:
            probs = self._probs(logits[rows], [requests[r] for r in rows]).cpu()  # [len(rows), vocab]
            for i, r in enumerate(rows):
                token_ids[r] = torch.multinomial(probs[i], 1, generator=requests[r].generator)[0]
        return token_ids.tolist()

    def _probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temperature = torch.tensor([req.sampling.temperature for req in requests], dtype=logits.dtype,
                                   device=logits.device)
        logits = logits / temperature[:, None]
        top_k = [req.sampling.top_k for req in requests]
        top_p = [req.sampling.top_p for req in requests]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) what falls outside each row's top_k and top_p; k <= 0 and p >= 1 are off."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [R, vocab]
    device = logits.device
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device)
    drop = torch.arange(vocab, device=device)[None, :] >= k[:, None]  # beyond the k-th
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=device)
    # Drop a token when the tokens before it already reach p; the first one always stays.
    drop = (probs.cumsum(dim=-1) - probs) >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
