"""top-k / top-p masking, exact on small hand-made rows."""

import math

import pytest
import torch

from replicas.sampling.sampler import apply_top_k_top_p


def kept(row) -> list[int]:
    return [i for i, x in enumerate(row.tolist()) if not math.isinf(x)]


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 3))
    out = apply_top_k_top_p(logits, top_k=[2, 0, 0], top_p=[1.0, 0.6, 0.75])
    assert kept(out[0]) == [1, 3]  # the two largest
    assert kept(out[1]) == [1, 3]  # 0.4 < 0.6, 0.4 + 0.3 reaches it
    assert kept(out[2]) == [1, 2, 3]  # 0.7 < 0.75: one more
    assert torch.equal(out[0][[1, 3]], logits[0][[1, 3]])


def test_top_p_keeps_at_least_one():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert kept(apply_top_k_top_p(logits, [0], [1e-6])[0]) == [0]


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
