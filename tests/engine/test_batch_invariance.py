"""engine.batch_invariant on SmolLM2 (the default model), in bfloat16 and float32: each of six prompts' 64 greedy
tokens, and the logprob of every one of them, are bit for bit the same
- alone (the reference),
- among seven concurrent requests of other lengths,
- with the prompt's prefix from the prefix cache,
- after a preemption (a pool too small for the thirteen: preempted requests recompute prompt and output),
- with that prefix back from the host tier after the pool evicted it.

With batch_invariant off the same comparison differs on this model in bf16 (`python -m bench.engine.invariance`,
docs/benchmarks.md): these replies are where a reduction order that follows the batch shows.
"""

import pytest

from core.engine_config import EngineConfig
from core.tokenizer import load_tokenizer
from replicas.engine.engine import Engine
from testing.chat import chat_ids
from testing.invariance import OTHERS, PROMPTS, first_difference, greedy_replies

TOKENS = 64


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request, smollm2_dir, alone_replies):
    """-> (make_engine, the six prompts' ids, the seven others' ids, each prompt's reply alone)."""
    dtype = request.param

    def make_engine(**overrides) -> Engine:
        engine = Engine(EngineConfig(model=str(smollm2_dir), dtype=dtype, **overrides))
        assert engine.model.batch_invariant, "batch_invariant is on by default where the native ops build"
        return engine

    alone = alone_replies(dtype)
    assert all(len(reply) == TOKENS for reply in alone)
    tokenizer = load_tokenizer(str(smollm2_dir))
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    others = [chat_ids(tokenizer, text) for text in OTHERS]
    return make_engine, prompts, others, alone


def assert_same(replies, alone) -> None:
    firsts = [first_difference(a, r) for a, r in zip(alone, replies)]
    assert firsts == [None] * len(alone), f"first differing token per prompt: {firsts}"


def test_among_other_requests_then_from_the_prefix_cache(setup):
    make_engine, prompts, others, alone = setup
    engine = make_engine()
    replies = greedy_replies(engine, prompts + others, TOKENS)[:len(prompts)]
    assert engine.stats.num_steps < len(prompts + others) * TOKENS  # they shared steps
    assert_same(replies, alone)
    cached_before = engine.stats.num_prompt_tokens_cached
    replies = greedy_replies(engine, prompts + others[:2], TOKENS)[:len(prompts)]
    assert engine.stats.num_prompt_tokens_cached - cached_before >= 16 * len(prompts)  # their full blocks
    assert_same(replies, alone)


def test_after_a_preemption_then_from_the_host_tier(setup):
    make_engine, prompts, others, alone = setup
    # 13 requests of ~100 tokens need ~90 blocks of 16: 40 make the scheduler preempt
    engine = make_engine(num_kv_blocks=40, host_tier_bytes=64 << 20)
    replies = greedy_replies(engine, others + prompts, TOKENS)[len(others):]
    assert engine.scheduler.num_preemptions > 0
    assert_same(replies, alone)
    greedy_replies(engine, others, 24)  # pushes the prompts' blocks out of the pool, into the tier
    restored_before = engine.host_tier.stats.num_blocks_restored
    replies = greedy_replies(engine, prompts, TOKENS)
    assert engine.host_tier.stats.num_blocks_restored > restored_before  # prefix blocks came back from the tier
    assert_same(replies, alone)
