"""Scheduler: budget, chunking, capacity, preemption order, freeing on finish (no model involved)."""

import pytest

from core.messages import SamplingParams
from replicas.cache.block_pool import BlockPool
from replicas.cache.kv_cache_manager import KVCacheManager
from replicas.engine.scheduler import Scheduler
from replicas.request.request import Request, RequestStatus


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=16):
    return Scheduler(KVCacheManager(BlockPool(num_blocks), block_size), max_num_seqs, budget)


def req(rid: str, n: int, max_tokens: int = 4, first: int | None = None) -> Request:
    first = 1 + 1000 * (ord(rid[0]) - ord("a")) if first is None else first  # distinct prompts: no prefix hits
    return Request(rid, list(range(first, first + n)), SamplingParams(temperature=0.0), max_tokens, frozenset({0}))


def plan(scheduled):
    return [(s.request.request_id, s.num_tokens, s.samples) for s in scheduled]


def test_chunked_prefill_under_the_budget_then_decode_with_the_next_prompt():
    s = make(budget=16)
    a, b = req("a", 20), req("b", 6)
    s.add(a), s.add(b)
    step = s.schedule()
    assert plan(step) == [("a", 16, False)]
    s.postprocess(step, [])
    step = s.schedule()
    assert plan(step) == [("a", 4, True), ("b", 6, True)]
    s.postprocess(step, [7, 8])
    assert a.token_ids[-1] == 7 and b.token_ids[-1] == 8
    assert plan(s.schedule()) == [("a", 1, True), ("b", 1, True)]


def test_capacity_and_finish_free_blocks():
    s = make(max_num_seqs=1)
    a, b = req("a", 4, max_tokens=1), req("b", 4)
    s.add(a), s.add(b)
    step = s.schedule()
    assert plan(step) == [("a", 4, True)]  # b waits: one sequence at a time
    s.postprocess(step, [9])
    assert a.status == RequestStatus.FINISHED_LENGTH and a.block_table == []
    assert plan(s.schedule()) == [("b", 4, True)]


def test_stop_token_finishes_and_preemption_takes_the_newest():
    s = make(num_blocks=3, block_size=4, budget=32)
    a, b = req("a", 4, max_tokens=8), req("b", 7, max_tokens=8)
    s.add(a), s.add(b)
    step = s.schedule()
    s.postprocess(step, [5, 6])  # a: 5 tokens (2 blocks); b: 8 tokens (2 blocks) -> only 3 blocks
    step = s.schedule()
    assert plan(step) == [("a", 1, True)]
    assert s.num_preemptions == 1 and b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    s.postprocess(step, [0])  # EOS
    assert a.status == RequestStatus.FINISHED_STOPPED
    # Recomputed with its sampled token; its first block (full, tail-first freed) is still cached.
    assert plan(s.schedule()) == [("b", 4, True)]
    assert b.num_computed_tokens == 4


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


def test_admission_reuses_a_cached_prefix_but_never_the_last_token():
    s = make(budget=64)
    a = req("a", 10, max_tokens=1, first=1)
    s.add(a)
    s.postprocess(s.schedule(), [7])  # a finishes; its 2 full blocks stay cached
    assert a.status == RequestStatus.FINISHED_LENGTH
    b, c = req("b", 12, first=1), req("c", 8, first=1)  # b shares 2 blocks + 2 tokens; c is exactly 2 blocks
    s.add(b), s.add(c)
    assert plan(s.schedule()) == [("b", 4, True), ("c", 4, True)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)  # c recomputes its last block
    assert b.block_table[:2] == c.block_table[:1] + [b.block_table[1]] and b.block_table[0] == c.block_table[0]
