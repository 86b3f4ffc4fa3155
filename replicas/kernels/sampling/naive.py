"""Row sampling, the PyTorch reference (the spec for the Triton kernel in triton_sample.py).

Per row of float32 logits: temperature 0 takes the argmax; otherwise the exponential race (Gumbel-max)

    token = argmax(logits / T - log(-log(u)))      u ~ Uniform(0, 1), one per vocabulary entry

which draws exactly from softmax(logits / T); masked entries (-inf) never win. The caller draws u, so a
seeded row draws it from its own generator and stays reproducible whatever else is in the batch. Also the
row's logsumexp of the raw logits, for the chosen token's logprob (logit - logsumexp, before temperature).
Ties go to the first index, as torch.argmax.
"""

import torch


def naive_sample_rows(logits: torch.Tensor, temperature: torch.Tensor,
                      noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [R, V] float32; temperature: [R] float32 (0 = greedy); noise: [R, V] float32 in (0, 1)
    # -> token_ids: [R] int64, logsumexp: [R] float32
    is_random = temperature > 0  # [R]
    temperature = torch.where(is_random, temperature, 1.0)
    scores = torch.where(is_random[:, None], logits / temperature[:, None] - torch.log(-torch.log(noise)), logits)
    return scores.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
