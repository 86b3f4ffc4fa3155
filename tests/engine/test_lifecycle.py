"""Request lifecycle: max_tokens exact, stop strings and stop ids end generation, aborts free every block,
seeded sampling does not depend on the batch, impossible requests are refused."""

import pytest

from core.messages import GenerateRequest, RequestError, SamplingParams
from tests.engine.conftest import greedy, prompts, run_all


def all_blocks_free(engine) -> bool:
    pool = engine.block_pool
    return all(c == 0 for c in pool.ref_counts) and pool.num_free_blocks == pool.num_blocks


def test_max_tokens_is_exact(make_engine):
    engine = make_engine()
    for n in (1, 2, 7):
        out = run_all(engine, [greedy("a", prompts([10])[0], max_tokens=n)])["a"]
        assert len(out) == n


def test_abort_mid_stream_frees_all_blocks(make_engine):
    engine = make_engine(block_size=4)
    run_ids = [f"r{i}" for i in range(3)]
    for rid, p in zip(run_ids, prompts([30, 9, 50])):
        engine.add_request(greedy(rid, p, max_tokens=100))
    for _ in range(5):
        engine.step()
    assert engine.block_pool.num_free_blocks < engine.block_pool.num_blocks
    engine.abort_request("r1")
    engine.abort_request("r0")
    engine.step()
    engine.abort_request("r2")
    assert not engine.has_unfinished()
    assert all_blocks_free(engine)


def test_stop_token_id_and_stop_string(make_engine):
    engine = make_engine()
    prompt = prompts([12])[0]
    free_run = run_all(engine, [greedy("a", prompt, 12)])["a"]
    stop_id = free_run[4]
    out = run_all(engine, [greedy("b", prompt, 12, stop_token_ids=[stop_id])])["b"]
    assert out == free_run[:free_run.index(stop_id) + 1]
    # A stop string taken from the free run's text ends the text right before it.
    text = engine.tokenizer.decode(free_run)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    engine.add_request(greedy("c", prompt, 12, stop=[stop]))
    pieces, reason = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            pieces.append(delta.text)
            reason = delta.finish_reason or reason
    assert reason == "stop"
    assert "".join(pieces) == text[:text.find(stop)]
    assert all_blocks_free(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine):
    def sampled(rid, prompt):
        return GenerateRequest(rid, prompt, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7,
                                                           max_tokens=16))
    engine = make_engine()
    ps = prompts([20, 35, 8])
    alone = run_all(engine, [sampled("x", ps[0])])["x"]
    together = run_all(engine, [greedy("g", ps[1]), sampled("x", ps[0]), sampled("y", ps[2])])
    assert together["x"] == alone


def test_impossible_requests_are_refused(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestError) as err:
        engine.add_request(greedy("a", prompts([64])[0]))
    assert err.value.param == "prompt" and err.value.status_code == 400
    with pytest.raises(RequestError) as err:
        engine.add_request(greedy("b", prompts([40])[0], max_tokens=30))
    assert err.value.param == "max_tokens"
    small = make_engine(num_kv_blocks=4, block_size=4)  # 16 tokens fit in the pool
    assert small.max_model_len == 16
    with pytest.raises(RequestError):
        small.add_request(greedy("c", prompts([20])[0]))


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
