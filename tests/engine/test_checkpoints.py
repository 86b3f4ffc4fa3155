"""Exact state checkpoints on a tiny hybrid model: a restored checkpoint gives token for token what a cold
run gives, at the history boundary, at the end of a turn, on a whole-prompt hit and one token short of it;
no boundary is saved twice; eviction under a tiny budget changes no output."""

import pytest
import torch

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from replicas.engine.engine import Engine
from tests.engine.conftest import greedy, prompts

BLOCK = 4
P = prompts([21], start=700)[0]
OTHER = prompts([12], start=3100)[0]


@pytest.fixture(scope="module")
def make_hybrid(tiny_hybrid_dir):
    def make(**overrides) -> Engine:
        return Engine(EngineConfig(model=str(tiny_hybrid_dir), dtype="float32", block_size=BLOCK, num_kv_blocks=256,
                                   **overrides))
    return make


def run(engine: Engine, prompt: list[int], max_tokens: int = 6, boundaries: list[int] = ()) -> tuple[list[int], dict]:
    """-> generated ids, and what the engine computed / restored for the prompt."""
    poison(engine)
    before = engine.stats.num_prompt_tokens_computed
    request = GenerateRequest(f"r{engine.stats.num_steps}-{len(prompt)}", prompt,
                              SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              checkpoint_positions=list(boundaries))
    engine.add_request(request)
    req = engine.requests[request.request_id]
    out = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.token_ids]
    return out, {"computed": engine.stats.num_prompt_tokens_computed - before, "cached": req.num_cached_tokens}


def poison(engine: Engine) -> None:
    """Garbage in every state slot and every block no one holds or caches: a restore must copy what it needs."""
    for layer in engine.runner.linear_states or []:
        layer.conv_state.normal_()
        layer.recurrent_state.normal_()
    pool = engine.block_pool
    unused = [b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0 and pool.block_hashes[b] is None]
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache[unused] = torch.randn_like(k_cache[unused])
        v_cache[unused] = torch.randn_like(v_cache[unused])


@pytest.fixture(scope="module")
def cold(make_hybrid):
    engine = make_hybrid(enable_state_checkpoints=False)
    return lambda prompt, max_tokens=6: run(engine, prompt, max_tokens)[0]


@pytest.fixture(scope="module")
def turn_one(make_hybrid):
    """An engine after one turn: prompt P, 6 generated; the turn's end is saved after P + C[:5]."""
    engine = make_hybrid()
    completion, _ = run(engine, P)
    assert engine.checkpointer.pool.num_saves == 1
    return engine, completion


def test_end_of_turn_restore(turn_one, cold):
    engine, c = turn_one
    follow_up = P + c + OTHER[:3]  # the last sampled token, a terminator, the new turn
    out, info = run(engine, follow_up)
    assert out == cold(follow_up)
    assert info["cached"] == len(P) + 5 and info["computed"] == 1 + 3


def test_hit_one_token_short_of_the_prompt(turn_one, cold):
    engine, c = turn_one
    out, info = run(engine, P + c)
    assert out == cold(P + c) and info["computed"] == 1


def test_whole_prompt_hit_samples_from_the_saved_hidden_row(turn_one, cold):
    engine, c = turn_one
    out, info = run(engine, P + c[:5])
    assert info["computed"] == 0 and info["cached"] == len(P) + 5
    assert out == cold(P + c[:5]) and out[0] == c[5]


def test_history_boundary_restore_and_no_boundary_saved_twice(make_hybrid, cold):
    engine = make_hybrid()
    run(engine, P, boundaries=[13])
    saves = engine.checkpointer.pool.num_saves
    assert saves == 2  # the boundary (13) and the turn's end
    branch = P[:13] + OTHER
    out, info = run(engine, branch)
    assert out == cold(branch) and info["cached"] == 13 and info["computed"] == len(OTHER)
    run(engine, P, boundaries=[13])  # the same boundaries again: restored, nothing saved twice
    assert engine.checkpointer.pool.num_saves == saves + 1  # only the branch's own turn end was new


def test_eviction_under_a_tiny_budget_changes_no_output(make_hybrid, cold):
    engine = make_hybrid(checkpoint_bytes=12_000)  # about one checkpoint of the tiny model
    outs = []
    for i in range(4):
        prompt = prompts([15 + i], start=500 + 37 * i)[0]
        first, _ = run(engine, prompt)
        second, _ = run(engine, prompt + first)
        outs.append((prompt, first, second))
    assert engine.checkpointer.pool.num_evictions > 0
    assert engine.checkpointer.pool.num_bytes <= 12_000
    for prompt, first, second in outs:
        assert first == cold(prompt) and second == cold(prompt + first)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoints_are_the_same_bits_however_the_prompt_was_chunked(tiny_hybrid_dir, dtype):
    """A 70-token prompt with boundaries at 21 and 64, prefilled in one step, in 16-token steps, and in 16-token
    steps beside another request: every saved checkpoint's conv and recurrent states and hidden row are equal
    bit for bit (the native recurrent ops run each sequence token by token; the linears are batch invariant)."""
    prompt, boundaries = prompts([70], start=4100)[0], [21, 64]
    saved = []
    for budget, rider in ((512, None), (16, None), (16, prompts([40], start=5200)[0])):
        engine = Engine(EngineConfig(model=str(tiny_hybrid_dir), dtype=dtype, block_size=BLOCK, num_kv_blocks=256,
                                     max_num_batched_tokens=budget))
        if rider is not None:
            engine.add_request(GenerateRequest("rider", rider, SamplingParams(temperature=0.0, max_tokens=30)))
        run(engine, prompt, max_tokens=2, boundaries=boundaries)
        pool = engine.checkpointer.pool
        saved.append([pool.lookup(prompt, n)[0] for n in boundaries])
    assert [c.num_tokens for c in saved[0]] == boundaries
    for other in saved[1:]:
        for a, b in zip(saved[0], other):
            assert a.num_tokens == b.num_tokens and torch.equal(a.hidden, b.hidden)
            assert all(torch.equal(x, y) for x, y in zip(a.conv_states + a.recurrent_states,
                                                         b.conv_states + b.recurrent_states))
