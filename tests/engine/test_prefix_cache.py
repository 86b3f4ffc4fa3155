"""Prefix cache: a hit produces token for token what a cold run produces; reference counts return to zero;
eviction under pressure never takes a block in use."""

import pytest

from tests.engine.conftest import greedy, run_all

BLOCK = 4
BASE = [300 + (11 * i) % 997 for i in range(48)]
OTHER = [2000 + i for i in range(48)]


def cold(make_engine, prompt, max_tokens=12):
    engine = make_engine(block_size=BLOCK, enable_prefix_caching=False)
    return run_all(engine, [greedy("cold", prompt, max_tokens)])["cold"]


# (warm-up prompt run first, prompt under test, prompt tokens expected from the cache)
CASES = {
    "share-nothing": (OTHER[:21], BASE[:21], 0),
    "share-one-block": (BASE[:4] + OTHER[:17], BASE[:21], 4),
    "share-many-blocks": (BASE[:20] + OTHER[:5], BASE[:21], 20),
    "whole-prompt": (BASE[:21], BASE[:21], 20),  # the last token is always recomputed
    "whole-prompt-but-one-token": (BASE[:21], BASE[:20] + [OTHER[0]], 20),
    "whole-prompt-on-a-block-edge": (BASE[:24], BASE[:20], 16),  # recompute the last block
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hit_equals_cold_run(make_engine, case):
    warm, prompt, expected_cached = CASES[case]
    engine = make_engine(block_size=BLOCK)
    run_all(engine, [greedy("warm", warm, 12)])
    computed_before = engine.stats.num_prompt_tokens_computed
    engine.add_request(greedy("hit", prompt, 12))
    req = engine.requests["hit"]
    out = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.token_ids]
    assert out == cold(make_engine, prompt)
    assert req.num_cached_tokens == expected_cached
    assert engine.stats.num_prompt_tokens_computed - computed_before == len(prompt) - expected_cached
    pool = engine.block_pool
    assert all(c == 0 for c in pool.ref_counts) and pool.num_free_blocks == pool.num_blocks
    assert pool.num_evictable_blocks > 0  # finished blocks stay reusable


def test_eviction_under_pressure_never_frees_a_block_in_use(make_engine):
    prompts = [BASE[:17], OTHER[:30], BASE[:8] + OTHER[30:45], OTHER[5:25], BASE[:17]]
    expected = {f"r{i}": cold(make_engine, p, 10) for i, p in enumerate(prompts)}
    engine = make_engine(block_size=BLOCK, num_kv_blocks=16, max_num_seqs=2)  # 64 tokens of KV
    pool = engine.block_pool
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(greedy(f"r{i}", p, 10))
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
        in_use = {b for req in engine.scheduler.running for b in req.block_table}
        assert all(pool.ref_counts[b] > 0 for b in in_use)
        assert not in_use & set(pool._free)  # a block in use is never in the free queue
        assert all(pool.block_hashes[b] is None or pool.cached[pool.block_hashes[b]] == b for b in range(16))
    assert outputs == expected
    assert pool.num_evictions > 0
    assert all(c == 0 for c in pool.ref_counts) and pool.num_free_blocks == pool.num_blocks


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
