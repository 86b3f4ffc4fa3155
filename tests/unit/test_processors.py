"""Logits processors, each against a hand-computed row on a vocabulary of 6; the plan touches only the rows
that ask, a batch where none asks has no plan, and a thrown-away draw is not history."""

import math

import pytest
import torch

from core.messages import SamplingParams
from replicas.engine.batch_builder import sampling_rows
from replicas.request.request import Request
from replicas.sampling.processors import apply_logits_plan, build_logits_plan
from replicas.sampling.sampler import Sampler

VOCAB = 6
EOS = 5
ROW = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0]
INF = math.inf


def request(prompt: list[int], output: list[int] = (), **sampling) -> Request:
    req = Request("r", list(prompt), SamplingParams(**{"temperature": 0.0, **sampling}), 16, frozenset({EOS}))
    req.token_ids += list(output)
    return req


def process(requests: list[Request], rows=None) -> torch.Tensor:
    logits = torch.tensor(rows or [ROW] * len(requests))
    return apply_logits_plan(logits, build_logits_plan(sampling_rows(requests), VOCAB))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    out = process([request([0, 1], [2], repetition_penalty=2.0)])
    # seen: 0 (prompt), 1 (prompt), 2 (generated); 3, 4, 5 unseen
    assert out[0].tolist() == [1.0, -4.0, 0.5, -1.0, 0.5, 3.0]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    out = process([request([4, 4], [1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)])
    # token 1: count 2 -> -0.5 - 0.5; token 3: count 1 -> -0.5 - 0.25; token 4 is in the prompt only
    assert out[0].tolist() == [2.0, -3.0, 1.0, -1.75, 0.5, 3.0]


def test_logit_bias_is_clamped_and_added():
    out = process([request([0], logit_bias={0: 150.0, 4: -2.5, 2: -1000.0})])
    assert out[0].tolist() == [102.0, -2.0, -99.0, -1.0, -2.0, 3.0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    out = process([request([0], [1], min_tokens=3, stop_token_ids=[2]),
                   request([0], [1], min_tokens=3, stop_token_ids=[2], ignore_eos=True)])
    assert out[0].tolist() == [2.0, -2.0, -INF, -1.0, 0.5, -INF]
    assert out[1].tolist() == [2.0, -2.0, -INF, -1.0, 0.5, 3.0]  # ignore_eos: the EOS stays
    assert build_logits_plan(sampling_rows([request([0], [1, 1, 1], min_tokens=3, stop_token_ids=[2])]), VOCAB) is None


def test_min_p_masks_tokens_below_min_p_times_the_top_probability():
    logits = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05]).log().tolist()  # float32 values
    out = process([request([0], min_p=0.3)], rows=[logits])  # threshold 0.15: only 0.5 and 0.2 stay
    assert out[0].tolist() == [logits[0], logits[1], -INF, -INF, -INF, -INF]


def test_all_processors_in_vllm_order():
    req = request([1], [3, 3], repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5,
                  logit_bias={1: 3.0, 0: 0.5}, min_tokens=4, min_p=0.01)
    out = process([req])
    # repetition: 1 -> -4, 3 -> -2; presence/frequency on 3 (count 2): -2 - 1 - 1 = -4;
    # bias: 0 -> 2.5, 1 -> -1; min_tokens: EOS 5 -> -inf; min_p 0.01 of e^2.5: keeps 0, 1, 2, 4 (e^-4 is below)
    assert out[0].tolist() == [2.5, -1.0, 1.0, -INF, 0.5, -INF]


def test_plan_covers_only_rows_that_ask_and_none_when_none_ask():
    plain = [request([0], [1]), request([2, 3]), request([4], temperature=0.7)]
    assert build_logits_plan(sampling_rows(plain), VOCAB) is None
    logits = torch.randn(4, VOCAB)
    assert apply_logits_plan(logits, None) is logits  # the plain path: no copy, no work
    mixed = [plain[0], request([0], [1], frequency_penalty=1.0), plain[1], request([0], min_p=0.5)]
    plan = build_logits_plan(sampling_rows(mixed), VOCAB)
    assert plan.rows.tolist() == [1, 3]
    before = logits.clone()
    out = apply_logits_plan(logits, plan)
    assert torch.equal(logits, before)  # the input is never modified
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # rows that did not ask: bit-identical
    assert out[1, 1].item() == pytest.approx(logits[1, 1].item() - 1.0)


def test_a_discarded_draw_is_not_history():
    req = request([0, 1], [2, 2], repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=6,
                  temperature=1.0, seed=3)
    logits = torch.tensor([ROW])
    before = apply_logits_plan(logits, build_logits_plan(sampling_rows([req]), VOCAB))
    Sampler()(logits, sampling_rows([req]))  # a draw the scheduler never appends
    after = apply_logits_plan(logits, build_logits_plan(sampling_rows([req]), VOCAB))
    assert torch.equal(before, after)
    req.token_ids.append(4)  # a kept draw is history
    kept = apply_logits_plan(logits, build_logits_plan(sampling_rows([req]), VOCAB))
    assert kept[0, 4].item() == pytest.approx(0.5 / 1.5 - 1.0)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
