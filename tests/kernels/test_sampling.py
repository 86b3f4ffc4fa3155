"""Row sampling (replicas/kernels/sampling): the Triton kernel (greedy argmax / exponential race + logsumexp) and
the dispatching sample_rows vs the PyTorch reference (naive.py), and the reference vs the distribution it
claims to draw from.

On CUDA the kernel runs compiled; elsewhere under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); its
tests skip where triton does not import. Token ids must match exactly (ties included: the first index wins,
as torch.argmax); logsumexp to float rounding. Awkward shapes: V not a multiple of the 1024-wide block, forced
splits over V, masked (-inf) entries, a row masked but for one entry, a fully masked row.
"""


import pytest
import torch

from replicas.kernels import sampling
from replicas.kernels.sampling.naive import naive_sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def triton_sample_rows():
    """The Triton launcher; the test skips where triton does not import."""
    pytest.importorskip("triton")
    from replicas.kernels.sampling.triton_sample import sample_rows

    return sample_rows


def sample_inputs(num_rows: int, vocab: int, seed: int = 0):
    """logits: [R, V] float32 with masked spans; temperature: [R] (even rows greedy); noise: [R, V] in (0, 1)"""
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(num_rows, vocab, generator=gen)
    logits[:, 5:vocab // 3] = float("-inf")  # top-k / top-p style masking
    temperature = 0.2 + 1.5 * torch.rand(num_rows, generator=gen)
    temperature[::2] = 0.0
    noise = torch.rand(num_rows, vocab, generator=gen).clamp_(1e-12, 1 - 1e-7)
    return logits.to(DEVICE), temperature.to(DEVICE), noise.to(DEVICE)


def check(kernel, logits, temperature, noise, num_splits=None):
    ref_ids, ref_lse = naive_sample_rows(logits, temperature, noise)
    ids, lse = kernel(logits, temperature, noise, num_splits=num_splits)
    assert ids.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu()), (ids, ref_ids)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "split3"])
@pytest.mark.parametrize("vocab", [1000, 5001])
@pytest.mark.parametrize("num_rows", [1, 5], ids=["R1", "R5"])
def test_kernel_matches_reference(triton_sample_rows, num_rows, vocab, num_splits):
    check(triton_sample_rows, *sample_inputs(num_rows, vocab, seed=vocab + num_rows), num_splits=num_splits)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0) = -inf
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split3"])
def test_ties_and_masked_rows(triton_sample_rows, num_splits):
    """bf16-valued logits tie often: greedy and drawn rows both keep the first maximal index, across splits."""
    gen = torch.Generator().manual_seed(1)
    vocab = 2500
    logits = torch.randint(-3, 4, (6, vocab), generator=gen).float()  # many exact ties
    logits[2] = float("-inf")
    logits[2, 2400] = 1.0  # one entry left, in the last split
    logits[3] = float("-inf")  # fully masked: argmax 0, logsumexp -inf (as torch)
    temperature = torch.tensor([0.0, 0.0, 0.7, 0.0, 0.0, 1.0])
    noise = torch.full((6, vocab), 0.5)  # equal noise: a drawn row's ties stay ties
    check(triton_sample_rows, logits.to(DEVICE), temperature.to(DEVICE), noise.to(DEVICE), num_splits=num_splits)


def test_reference_draws_from_softmax_over_temperature():
    """The exponential race on the reference: frequencies follow softmax(logits / T)."""
    gen = torch.Generator().manual_seed(0)
    num_draws = 40000
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf")]).expand(num_draws, 5)
    temperature = torch.full((num_draws,), 0.8)
    ids, lse = naive_sample_rows(logits, temperature, torch.rand(num_draws, 5, generator=gen))
    freq = torch.bincount(ids, minlength=5).float() / num_draws
    torch.testing.assert_close(freq, (logits[0] / 0.8).softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))


def test_dispatch_on_cpu_is_the_reference():
    """sample_rows on CPU tensors is naive_sample_rows (the Triton kernel is for CUDA only)."""
    logits, temperature, noise = (t.cpu() for t in sample_inputs(5, 1000, seed=2))
    assert not sampling.use_triton(logits)
    ids, lse = sampling.sample_rows(logits, temperature, noise)
    ref_ids, ref_lse = naive_sample_rows(logits, temperature, noise)
    assert torch.equal(ids, ref_ids) and torch.equal(lse, ref_lse)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
