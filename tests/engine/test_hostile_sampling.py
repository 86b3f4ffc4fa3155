"""Sampling values at the edge of float32, found by bench/reliability/fuzz.py: each once killed the engine's
step loop (NaN probabilities, a tensor size mismatch, a row with no token to draw). Now each request runs or
fails alone, and the requests beside it finish."""

import pytest

from core.messages import GenerateRequest, SamplingParams, StructuredSpec
from tests.engine.conftest import prompts, run_all


def request(rid: str, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, prompts([9])[0], SamplingParams(max_tokens=6, **{"seed": 1, **sampling}))


def run(engine, requests) -> tuple[dict, dict]:
    """-> (ids per request, error per failed one)."""
    return run_all(engine, requests), dict(engine.take_failures())


@pytest.mark.parametrize("sampling", [
    {"temperature": 1e-45},  # a float32 zero: logits / t are inf, softmax NaN
    {"temperature": 0.8, "top_p": 5e-324},  # p rounds to 0: every token dropped
    {"temperature": 0.8, "top_k": 5_179_377},  # past the vocabulary: off
    {"temperature": 0.8, "repetition_penalty": 1e-57},  # a float32 zero: x / 0
], ids=["tiny temperature", "tiny top_p", "huge top_k", "tiny repetition_penalty"])
def test_edge_values_run(make_engine, sampling):
    engine = make_engine()
    out, failures = run(engine, [request("edge", **sampling), request("beside", temperature=0.8)])
    assert not failures and len(out["edge"]) == 6 and len(out["beside"]) == 6


def test_a_grammar_no_token_can_follow_fails_that_request_only(make_engine):
    engine = make_engine()
    impossible = StructuredSpec("choice", "", choices=["\x04"], param="structured_outputs")
    out, failures = run(engine, [request("stuck", temperature=0.0, structured=impossible),
                                 request("beside", temperature=0.8)])
    assert set(failures) == {"stuck"} and failures["stuck"].status_code == 400
    assert failures["stuck"].param == "structured_outputs"
    assert len(out["beside"]) == 6 and not engine.has_unfinished()
