"""Row sampling on the device: greedy argmax or an exponential-race draw per row, and the row's logsumexp.

What it is for: the Sampler's draw (replicas/sampling/sampler.py steps 3 and 6, and the logsumexp step 7 needs
for the chosen token's logprob) in one kernel on CUDA, so a decode step does not move [R, vocab] probabilities
to the host for torch.multinomial. The caller keeps everything before the draw (logits processors, top-k /
top-p masking to -inf) and supplies the noise, drawing each seeded row's u from that request's generator (the
draw then depends on the generator's uniform stream, not on torch.multinomial's: same seed, other tokens than
the multinomial path). Top alternatives (top_logprobs) are not computed here. Not wired into the Sampler:
that is the Sampler's decision.

    sample_rows(logits [R, V] f32, temperature [R] f32, noise [R, V] f32) -> (token_ids [R] i64, logsumexp [R] f32)

On CUDA with triton importable: the Triton kernel (triton_sample.py); elsewhere the reference (naive.py).
"""

import functools

import torch

from replicas.kernels.sampling.naive import naive_sample_rows


@functools.cache
def _triton_sample_rows():
    """The Triton launcher, or None. Imported on first CUDA use only."""
    try:
        from replicas.kernels.sampling.triton_sample import sample_rows as triton_sample_rows
    except Exception:  # not installed, or no working triton
        return None
    return triton_sample_rows


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_sample_rows() is not None


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor,
                noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(logits):
        return _triton_sample_rows()(logits, temperature, noise)
    return naive_sample_rows(logits, temperature, noise)


__all__ = ["naive_sample_rows", "sample_rows", "use_triton"]
