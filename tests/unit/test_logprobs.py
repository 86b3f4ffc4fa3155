"""Logprobs: log_softmax over the whole vocabulary of the processed logits (float32), alternatives most
likely first, -inf never listed; the sampler scores before temperature."""

import math

import pytest
import torch

from core.messages import SamplingParams
from replicas.engine.batch_builder import sampling_rows
from replicas.request.request import Request
from replicas.sampling.logprobs import compute_logprobs
from replicas.sampling.processors import apply_logits_plan, build_logits_plan
from replicas.sampling.sampler import Sampler


def test_logprobs_equal_log_softmax_and_top_is_sorted():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4  # [R, vocab]
    token_ids = torch.tensor([7, 0, 49])
    entries = compute_logprobs(logits, token_ids, [5, 0, 50])
    reference = torch.log_softmax(logits, dim=-1)
    for r, entry in enumerate(entries):
        assert entry.token_id == token_ids[r].item()
        assert entry.logprob == pytest.approx(reference[r, entry.token_id].item(), abs=1e-5)
        for token_id, logprob in entry.top:
            assert logprob == pytest.approx(reference[r, token_id].item(), abs=1e-5)
    assert [t for t, _ in entries[0].top] == reference[0].argsort(descending=True)[:5].tolist()
    assert entries[1].top == []
    values = [lp for _, lp in entries[2].top]
    assert len(values) == 50 and values == sorted(values, reverse=True)
    # Not renormalised over the listed entries: the five listed do not sum to 1.
    assert sum(math.exp(lp) for _, lp in entries[0].top) < 1.0


def test_minus_infinity_is_never_listed():
    logits = torch.tensor([[1.0, -math.inf, 0.0, -math.inf, 2.0]])
    entry = compute_logprobs(logits, torch.tensor([4]), [5])[0]
    assert [t for t, _ in entry.top] == [4, 0, 2]
    expected = torch.log_softmax(logits, dim=-1)[0]
    assert entry.logprob == expected[4].item()


def test_sampler_logprobs_are_of_processed_logits_before_temperature():
    vocab = 8
    req = Request("r", [1, 2], SamplingParams(temperature=0.5, seed=11, logprobs=3, presence_penalty=1.5,
                                              logit_bias={6: 2.0}, min_tokens=2), 16, frozenset({7}))
    req.token_ids += [3]
    plain = Request("p", [1], SamplingParams(temperature=0.0), 16, frozenset({7}))
    logits = torch.tensor([[0.1, 0.4, -0.3, 1.2, 0.0, 0.7, -1.0, 2.0]] * 2)
    out = Sampler()(logits, sampling_rows([req, plain]))
    processed = apply_logits_plan(logits, build_logits_plan(sampling_rows([req, plain]), vocab))
    reference = torch.log_softmax(processed[0], dim=-1)
    entry = out.logprobs[0]
    assert entry.token_id == out.token_ids[0]
    assert entry.logprob == pytest.approx(reference[entry.token_id].item(), abs=1e-6)
    assert [t for t, _ in entry.top] == reference.argsort(descending=True)[:3].tolist()
    assert 7 not in [t for t, _ in entry.top]  # the EOS is at -inf while min_tokens binds
    assert out.logprobs[1] is None and out.token_ids[1] == 7  # the plain greedy row: raw argmax


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
