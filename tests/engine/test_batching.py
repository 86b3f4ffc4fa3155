"""Batching changes nothing: batched greedy == each request alone; chunked prefill == whole prefill;
preemption under a small pool == no preemption."""

import pytest

from tests.engine.conftest import greedy, prompts, run_all

LENGTHS = [3, 17, 40, 64, 5, 33, 90, 12]  # 8 requests of different lengths


@pytest.fixture(scope="module")
def alone(make_engine):
    engine = make_engine()
    return {f"r{i}": run_all(engine, [greedy(f"r{i}", p, 24)])[f"r{i}"] for i, p in enumerate(prompts(LENGTHS))}


def test_eight_concurrent_requests_equal_each_alone(make_engine, alone):
    engine = make_engine()
    batched = run_all(engine, [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts(LENGTHS))])
    assert batched == alone
    assert engine.stats.num_steps < sum(len(v) for v in alone.values())  # they really shared steps


def test_chunked_prefill_equals_whole_prefill(make_engine, alone):
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=8)  # a 90-token prompt takes 6 chunks
    chunked = run_all(engine, [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts(LENGTHS))])
    assert chunked == alone


def test_late_joiners_equal_alone(make_engine, alone):
    engine = make_engine()
    requests = [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts(LENGTHS))]
    outputs = {r.request_id: [] for r in requests}
    for step, request in enumerate(requests):  # a new request joins the running batch every step
        engine.add_request(request)
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
    assert outputs == alone


def test_preemption_recomputes_exactly(make_engine, alone):
    # 40 blocks of 4 tokens: the batch cannot all fit, so requests are preempted and recomputed.
    engine = make_engine(num_kv_blocks=40, block_size=4, max_num_seqs=8)
    assert engine.block_pool.num_blocks * 4 < sum(n + 24 for n in LENGTHS)
    outputs = run_all(engine, [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts(LENGTHS))])
    assert engine.scheduler.num_preemptions > 0
    assert outputs == alone
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
