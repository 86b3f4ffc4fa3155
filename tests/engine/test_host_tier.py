"""Host tier in a real engine: blocks the pool evicted come back from the tier for the conversation's next turn,
whose output equals a cold run's token for token (and an engine's without the tier); on the tiny hybrid, an
evicted checkpoint comes back with its blocks and the earlier turn is not recomputed."""

import pytest
import torch

from core.engine_config import EngineConfig
from core.hashing import block_hashes
from core.messages import GenerateRequest, SamplingParams
from replicas.engine.engine import Engine
from tests.engine.conftest import prompts
from tests.engine.test_checkpoints import poison

BLOCK = 4
A, B, C = prompts([26, 30, 30], start=500)
P, Q, R = prompts([21, 23, 25], start=700)
OTHER = prompts([12], start=3100)[0]


def run(engine: Engine, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], dict]:
    """-> generated ids, and the prompt tokens served from cache / computed."""
    poison(engine)
    before = engine.stats.num_prompt_tokens_computed
    request_id = f"r{engine.stats.num_steps}"
    engine.add_request(GenerateRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True)))
    req = engine.requests[request_id]
    out = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.token_ids]
    return out, {"cached": req.num_cached_tokens, "computed": engine.stats.num_prompt_tokens_computed - before}


def conversation(engine: Engine) -> tuple[list[int], list[int], dict]:
    """Turn 1 of A, two other conversations that push A out of the pool, then A's turn 2."""
    first, _ = run(engine, A)
    run(engine, B)
    run(engine, C)
    held = [engine.block_pool.find(x) is not None for x in block_hashes(A + first, BLOCK)]
    follow_up = A + first + OTHER[:3]
    second, info = run(engine, follow_up)
    return first + second, held, info


@pytest.mark.parametrize("codec", ["zlib", "none"])
def test_blocks_evicted_to_the_tier_come_back_exact(make_engine, codec):
    engine = make_engine(block_size=BLOCK, num_kv_blocks=20, host_tier_bytes=1 << 20, host_tier_codec=codec)
    out, held, info = conversation(engine)
    assert not any(held)  # the pool had forgotten turn 1 when turn 2 came
    # Turn 1 fed 26 + 7 tokens forward: 8 full blocks, all back from the tier; the rest computed.
    assert info == {"cached": 32, "computed": 26 + 8 + 3 - 32}
    assert engine.host_tier.stats.num_blocks_restored == 8
    without_tier, _, info_without = conversation(make_engine(block_size=BLOCK, num_kv_blocks=20))
    assert info_without["cached"] == 0
    cold = make_engine(block_size=BLOCK, enable_prefix_caching=False)
    assert out == without_tier == run(cold, A)[0] + run(cold, A + out[:8] + OTHER[:3])[0]


@pytest.fixture(scope="module")
def make_hybrid(tiny_hybrid_dir):
    def make(**overrides) -> Engine:
        return Engine(EngineConfig(model=str(tiny_hybrid_dir), dtype="float32", block_size=BLOCK, **overrides))
    return make


def test_hybrid_checkpoint_evicted_to_the_tier_comes_back(make_hybrid):
    # Room for about one checkpoint, and 16 blocks: the later turns push P's checkpoint and blocks out.
    engine = make_hybrid(checkpoint_bytes=12_000, num_kv_blocks=16, host_tier_bytes=1 << 20)
    first, _ = run(engine, P, 6)
    run(engine, Q, 6)
    run(engine, R, 6)
    assert not engine.checkpointer.pool.has(P + first[:5])  # the turn's end is in the tier now
    assert not all(engine.block_pool.find(x) for x in block_hashes(P + first[:5], BLOCK))
    follow_up = P + first + OTHER[:3]  # the last sampled token, a terminator, the new turn
    out, info = run(engine, follow_up, 6)
    assert info == {"cached": len(P) + 5, "computed": 1 + 3}  # turn 1 not recomputed
    stats = engine.host_tier.stats
    assert stats.num_checkpoints_restored == 1 and stats.num_blocks_restored > 0
    cold = make_hybrid(enable_state_checkpoints=False, num_kv_blocks=64)
    assert out == run(cold, follow_up, 6)[0] and first == run(cold, P, 6)[0]


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


def test_a_leaving_replica_exports_what_its_tier_holds(make_engine):
    """Migration (replicas/engine/migration.py) takes a conversation's blocks from the tier too, bit for bit."""
    from replicas.engine.migration import export_states

    def exported(engine: Engine, evict: bool):
        first, _ = run(engine, A)
        engine.retention.store.put("conversation", "alice", A + first)
        if evict:
            run(engine, B)
            run(engine, C)
        [state] = export_states(engine, 1 << 30, float("inf"))
        return state, A + first

    tiered = make_engine(block_size=BLOCK, num_kv_blocks=20, host_tier_bytes=1 << 20)
    state, ids = exported(tiered, evict=True)
    assert tiered.host_tier.stats.num_blocks_restored > 0  # they were in the tier, not the pool
    roomy_state, roomy_ids = exported(make_engine(block_size=BLOCK, num_kv_blocks=256), evict=False)
    assert ids == roomy_ids and len(state.block_hashes) == len(ids) // BLOCK == len(roomy_state.block_hashes)
    assert torch.equal(state.kv, roomy_state.kv)
