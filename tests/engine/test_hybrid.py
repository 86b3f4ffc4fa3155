"""The engine on a tiny random hybrid model (Qwen3.5-text: GatedDeltaNet + gated attention layers):
greedy equals transformers, batching and chunking change nothing, preemption recomputes exactly,
state slots come back."""

import pytest
import torch

from core.engine_config import EngineConfig
from replicas.engine.engine import Engine
from tests.engine.conftest import greedy, prompts, run_all

LENGTHS = [3, 17, 40, 64, 5, 33, 90, 12]


@pytest.fixture(scope="module")
def make_hybrid(tiny_hybrid_dir):
    def make(**overrides) -> Engine:
        return Engine(EngineConfig(model=str(tiny_hybrid_dir), dtype="float32", **overrides))
    return make


@pytest.fixture(scope="module")
def alone(make_hybrid):
    engine = make_hybrid()
    return {f"r{i}": run_all(engine, [greedy(f"r{i}", p, 16)])[f"r{i}"] for i, p in enumerate(prompts(LENGTHS))}


def test_greedy_equals_transformers_generate(tiny_hybrid_dir, alone):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_hybrid_dir), dtype=torch.float32).eval()
    for i, p in enumerate(prompts(LENGTHS)[:3]):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert alone[f"r{i}"] == out[0, len(p):].tolist()


def test_batched_and_chunked_equal_alone(make_hybrid, alone):
    batched = make_hybrid()
    assert run_all(batched, [greedy(f"r{i}", p, 16) for i, p in enumerate(prompts(LENGTHS))]) == alone
    chunked = make_hybrid(max_num_batched_tokens=16, max_num_seqs=8)
    assert run_all(chunked, [greedy(f"r{i}", p, 16) for i, p in enumerate(prompts(LENGTHS))]) == alone
    slots = chunked.scheduler.state_slots
    assert slots.num_free_slots == slots.num_slots  # every slot back


def test_preemption_recomputes_the_state_exactly(make_hybrid, alone):
    engine = make_hybrid(num_kv_blocks=40, block_size=4, max_num_seqs=8)
    outputs = run_all(engine, [greedy(f"r{i}", p, 16) for i, p in enumerate(prompts(LENGTHS))])
    assert engine.scheduler.num_preemptions > 0
    assert outputs == alone
    assert engine.scheduler.state_slots.num_free_slots == 8


def test_no_attention_prefix_reuse_without_state_checkpoints(make_hybrid):
    engine = make_hybrid()
    p = prompts([50])[0]
    first = run_all(engine, [greedy("a", p, 8)])["a"]
    engine.add_request(greedy("b", p, 8))
    request = engine.requests["b"]
    second = []
    while engine.has_unfinished():
        second += [t for d in engine.step() for t in d.token_ids]
    assert request.num_cached_tokens == 0  # the linear layers' state at the prefix was never saved
    assert second == first

if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
