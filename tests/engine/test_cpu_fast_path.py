"""The CPU fast path changes no output: packed bf16 weights vs F.linear, and the step thread that owns
every torch op of a replica."""

import asyncio
import threading

import pytest
import torch

from core.engine_config import EngineConfig
from core.messages import RequestError
from core.messages import GenerateDelta
from replicas.engine.async_engine import AsyncEngine, is_delivery_due
from replicas.engine.engine import Engine
from replicas.kernels.cpu_linear import PackedLinear, can_pack
from tests.engine.conftest import greedy, prompts, run_all


@pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="this torch has no oneDNN packing")
def test_packed_bfloat16_weights_generate_the_same_tokens(tiny_llama_dir):
    engines = {pack: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", pack_weights=pack,
                                         batch_invariant=False))  # which puts every linear on its own kernel
               for pack in (True, False)}
    assert any(isinstance(m, PackedLinear) for m in engines[True].model.modules())
    assert not any(isinstance(m, PackedLinear) for m in engines[False].model.modules())
    requests = lambda: [greedy(f"r{i}", p, max_tokens=24) for i, p in enumerate(prompts([5, 17, 40, 3]))]
    packed, plain = run_all(engines[True], requests()), run_all(engines[False], requests())
    assert packed == plain and all(len(ids) == 24 for ids in packed.values())


def test_the_engine_is_built_and_stepped_on_one_thread_with_its_thread_count(tiny_llama_dir):
    seen = {}

    def build() -> Engine:
        seen["thread"], seen["threads"] = threading.current_thread(), torch.get_num_threads()
        return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))

    engine = AsyncEngine(build, num_threads=1)
    try:
        assert seen == {"thread": engine._thread, "threads": 1}
        assert seen["thread"] is not threading.current_thread()

        async def generate():
            return [d async for d in engine.generate(greedy("a", prompts([9])[0], max_tokens=5))]

        deltas = asyncio.run(generate())
        assert [d.finish_reason for d in deltas][-1] == "length" and sum(len(d.token_ids) for d in deltas) == 5
    finally:
        engine.shutdown()


def test_a_slow_reader_gets_the_ready_tokens_as_one_delta_and_loses_nothing(tiny_llama_dir):
    """Deltas that queue while the caller is busy (a slow HTTP path) come out merged: fewer, larger
    deltas whose ids, text and logprobs are exactly a prompt reader's."""
    engine = AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")))
    request = lambda rid: greedy(rid, prompts([9])[0], max_tokens=12, logprobs=1, ignore_eos=True)  # noqa: E731

    async def read(rid: str, pause_s: float):
        deltas = []
        async for delta in engine.generate(request(rid)):
            deltas.append(delta)
            await asyncio.sleep(pause_s)  # the caller busy elsewhere while the engine steps on
        return deltas

    try:
        prompt_reader, slow_reader = asyncio.run(read("prompt", 0.0)), asyncio.run(read("slow", 0.2))
    finally:
        engine.shutdown()
    joined = lambda ds: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds),  # noqa: E731
                         [(e.token_id, e.logprob) for d in ds for e in d.logprobs])
    assert joined(slow_reader) == joined(prompt_reader) and len(joined(slow_reader)[0]) == 12
    assert len(slow_reader) < 12  # merged: fewer deltas than tokens
    assert slow_reader[0].prompt_token_ids == prompts([9])[0] and slow_reader[-1].finish_reason == "length"
    assert slow_reader[-1].num_generated_tokens == 12


def test_stream_interval_groups_tokens_only_while_many_streams_decode(tiny_llama_dir):
    """stream_interval 4: with 4 streams decoding, each stream's first token comes at once and the rest
    in groups of 4. Nothing is lost or reordered, grouped or not, alone or together."""
    engines = {k: AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")),
                              stream_interval=k) for k in (1, 4)}
    request = lambda rid: greedy(rid, prompts([9])[0], max_tokens=10, ignore_eos=True, logprobs=0)  # noqa: E731

    async def read(engine: AsyncEngine, num_streams: int):
        async def one(rid: str):
            return [d async for d in engine.generate(request(rid))]
        return await asyncio.gather(*(one(f"r{i}") for i in range(num_streams)))

    try:
        alone = {k: asyncio.run(read(engine, 1))[0] for k, engine in engines.items()}
        together = {k: asyncio.run(read(engine, 4)) for k, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    joined = lambda ds: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds),  # noqa: E731
                         [e.token_id for d in ds for e in d.logprobs])
    for grouped, plain in zip(together[4], together[1]):
        counts = [d.num_generated_tokens for d in grouped]  # [1, 4, 8, 10]: tokens 1 | 2-4 | 5-8 | 9-10
        # (a reader that lags may get two groups as one: only the boundaries are fixed)
        assert counts[-1] == 10 and all(c == 1 or c % 4 == 0 for c in counts[:-1]) and len(counts) <= 4
        assert joined(grouped) == joined(plain) == joined(alone[1])


def test_delivery_is_due_token_by_token_for_few_streams_and_in_groups_for_many():
    delta = lambda n, finish=None: GenerateDelta("r", [n], "x", finish, num_generated_tokens=n)  # noqa: E731
    assert all(is_delivery_due(delta(n), num_step_deltas=3, stream_interval=4) for n in range(1, 12))
    due = [n for n in range(1, 12) if is_delivery_due(delta(n), num_step_deltas=8, stream_interval=4)]
    assert due == [1, 4, 8]  # the first token at once, then every 4th
    assert is_delivery_due(delta(6, "stop"), num_step_deltas=8, stream_interval=4)  # the last always
    assert all(is_delivery_due(delta(n), num_step_deltas=8, stream_interval=1) for n in range(1, 12))


def test_an_engine_that_fails_to_build_raises_in_the_constructor():
    def build() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        AsyncEngine(build)


def test_a_shut_down_engine_refuses_requests_instead_of_hanging(tiny_llama_dir):
    engine = AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")))
    engine.shutdown()

    async def generate():
        return [d async for d in engine.generate(greedy("late", prompts([4])[0]))]

    with pytest.raises(RequestError, match="shutting down") as refused:
        asyncio.run(asyncio.wait_for(generate(), timeout=10))
    assert refused.value.status_code == 503  # retryable: another replica serves it


def test_a_bf16_checkpoints_float32_head_keeps_bf16_weights_and_their_float32_sums(tiny_llama_dir, tmp_path):
    """A checkpoint stored in bf16, served in bf16: its head stays float32 (logits at float32 precision) but
    its weights are bf16 values, so the head keeps them in bf16 (half the bytes a decode step reads) and gives
    the logits of their float32 copy bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    from replicas.kernels.cpu_linear.invariant_native import (InvariantBf16WeightLinear, InvariantLinear,
                                                              native_invariant)

    if native_invariant() is None:
        pytest.skip("the fixed-order linear kernel did not build")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, tmp_path / name)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="bfloat16"))
    assert isinstance(engine.model.lm_head, InvariantBf16WeightLinear)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).to(torch.bfloat16).float()
    dense = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    with torch.no_grad():
        dense.weight.copy_(head)
    reference = InvariantLinear(dense)  # the float32 copy on the same fixed-order kernel
    hidden = torch.randn(5, head.shape[1])
    with torch.inference_mode():
        assert torch.equal(engine.model.compute_logits(hidden), reference(hidden))
