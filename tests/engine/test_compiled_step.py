"""The compiled step (engine.compile_step, replicas/engine/compiled_step.py): one graph for every batch shape,
the same tokens and logprobs as the eager forward bit for bit, and eager wherever it does not apply."""

import logging

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from replicas.engine.compiled_step import CompiledForward, host_key, warm_up_scheduled
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine
from replicas.kernels.cpu_linear.gguf_blocks import GGUFLinear
from replicas.kernels.fused_cpu import fused_ops
from testing.tiny_gguf import T, write_tiny_gguf
from tests.engine.conftest import prompts

pytestmark = pytest.mark.skipif(fused_ops() is None, reason="the compiled step needs the native ops")


def replies(engine: Engine, lengths: list[int], max_tokens: int = 12) -> dict[str, tuple]:
    """Greedy ids and each token's logprob, for prompts of `lengths` all at once (prefill chunks beside decode
    rows, then decode batches that shrink as requests end)."""
    out: dict[str, tuple[list, list]] = {}
    for i, prompt in enumerate(prompts(lengths)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens - i % 3, logprobs=0)
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
        out[f"r{i}"] = ([], [])
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id][0].extend(delta.token_ids)
            out[delta.request_id][1].extend(entry.logprob for entry in delta.logprobs or [])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_is_the_eager_step_bit_for_bit(tiny_llama_dir, dtype):
    """1 to 6 rows of decode, chunked prefills (max_num_batched_tokens 64) beside them: one graph, compiled at
    start-up, never again; every token and logprob equal to the eager engine's."""
    config = dict(model=str(tiny_llama_dir), dtype=dtype, max_num_batched_tokens=64)
    eager = replies(Engine(EngineConfig(**config, compile_step=False)), [5, 130, 1, 40, 17, 64])
    torch._dynamo.reset()  # this process may have traced the same model already (Dynamo's in-memory cache)
    counters.clear()
    engine = Engine(EngineConfig(**config, compile_step=True))
    assert isinstance(engine.runner.forward, CompiledForward) and engine.runner.forward.compiled
    assert counters["stats"]["unique_graphs"] == 1  # at start-up
    compiled = replies(engine, [5, 130, 1, 40, 17, 64])
    assert counters["stats"]["unique_graphs"] == 1, "a step shape recompiled"
    assert compiled == eager
    assert sum(len(ids) for ids, _ in compiled.values()) > 40


# A GGUF's layers keep its blocks (gguf_blocks.py): legacy and K-quant types side by side, the head Q6_K
GGUF_TYPES = dict(token_embd=T.Q8_0, output=T.Q6_K, attn_q=T.Q4_0, attn_k=T.Q4_K, attn_v=T.Q6_K,
                  attn_output=T.Q4_1, ffn_gate=T.Q5_K, ffn_up=T.Q5_0, ffn_down=T.Q8_0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_runs_gguf_blocks_as_eager_does(tmp_path, dtype):
    """The GGUF block op is one custom op for every row count, so one graph holds decode and prefill."""
    path = tmp_path / "blocks.gguf"
    write_tiny_gguf(path, "llama", GGUF_TYPES, seed=3, tied=False, head_dim=64)
    config = dict(model=str(prepare_model(str(path), cache_dir=tmp_path / "cache", progress=False)),
                  dtype=dtype, max_num_batched_tokens=64)
    eager_engine = Engine(EngineConfig(**config, compile_step=False))
    assert isinstance(eager_engine.model.lm_head, GGUFLinear)
    eager = replies(eager_engine, [3, 90, 1, 33, 20])
    engine = Engine(EngineConfig(**config, compile_step=True))
    assert engine.runner.forward.compiled
    assert replies(engine, [3, 90, 1, 33, 20]) == eager


def test_a_step_that_outgrows_the_batch_buffers_recompiles_nothing(tiny_llama_dir):
    """The step's buffers start at 256 tokens / 16 sequences and grow inside a step (under inference mode):
    regrown as inference tensors they changed the inputs' dispatch keys, and the graph recompiled."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile_step=True))
    graphs = counters["stats"]["unique_graphs"]
    first = engine.runner.batch_builder.tokens
    out = replies(engine, [300, 200, *[4] * 18])  # 500 prompt tokens and 20 sequences in one step
    assert engine.runner.batch_builder.tokens is not first  # the buffers grew
    assert counters["stats"]["unique_graphs"] == graphs, "a grown buffer recompiled the step"
    assert all(len(ids) >= 10 for ids, _ in out.values())


def test_default_is_on_and_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv("TETHER_COMPILE_STEP", raising=False)
    assert EngineConfig().compile_step
    monkeypatch.setenv("TETHER_COMPILE_STEP", "0")
    assert not EngineConfig().compile_step
    assert EngineConfig(compile_step=True).compile_step


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 0.1)])
def test_compiled_hybrid_step_matches_eager(tiny_hybrid_dir, dtype, tol):
    """A hybrid model's recurrent layers on their native ops trace into the one graph (the step's slots are
    unbacked like its tokens). Its zero-centred norms and attention output gate are PyTorch ops, which Inductor
    writes its own code for: the same greedy tokens as eager, logprobs within float rounding (not the bits, as
    with Llama, whose every op is native). Within the compiled engine a checkpoint hit is the cold run exactly."""
    config = dict(model=str(tiny_hybrid_dir), dtype=dtype, max_num_batched_tokens=64, checkpoint_every=16)
    eager = replies(Engine(EngineConfig(**config, compile_step=False)), [5, 130, 1, 40, 17, 64])
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(EngineConfig(**config, compile_step=True))
    assert isinstance(engine.runner.forward, CompiledForward) and engine.runner.forward.compiled
    compiled = replies(engine, [5, 130, 1, 40, 17, 64])
    assert counters["stats"]["unique_graphs"] == 1, "a step shape recompiled"
    assert {k: ids for k, (ids, _) in compiled.items()} == {k: ids for k, (ids, _) in eager.items()}
    diffs = [abs(a - b) for k in eager for a, b in zip(eager[k][1], compiled[k][1])]
    assert len(diffs) > 40 and max(diffs) <= tol
    cached_before = engine.stats.num_prompt_tokens_cached
    again = replies(engine, [5, 130, 1, 40, 17, 64])  # prefix hits resume from recurrent-state checkpoints
    assert again == compiled and engine.stats.num_prompt_tokens_cached > cached_before


def test_pytorch_recurrent_layers_and_off_stay_eager(tiny_hybrid_dir, tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        hybrid = Engine(EngineConfig(model=str(tiny_hybrid_dir), dtype="float32", compile_step=True,
                                     native_kernels=False))
    assert hybrid.runner.forward is hybrid.model
    assert "compiled step off: the native ops are off" in caplog.text
    off = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile_step=False))
    assert off.runner.forward is off.model
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        variant = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile_step=True,
                                      batch_invariant=False))
    assert variant.runner.forward is variant.model and "compiled step off: batch_invariant is off" in caplog.text


class DataDependent(nn.Module):
    """A forward fullgraph tracing rejects: a Python branch on a tensor's value."""

    def forward(self, input_ids, positions, kv_caches, batch):
        return input_ids * 2 if input_ids.sum() > 0 else input_ids - 1


def test_a_failed_compile_falls_back_to_eager(tiny_llama_dir, caplog):
    """A real compile failure (not a stand-in): the forward runs eagerly from then on, with the reason logged."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", compile_step=False))
    batch = engine.runner.batch_builder.build(warm_up_scheduled([0]))
    model = DataDependent()
    forward = CompiledForward(model)
    ids = torch.tensor([3, 4])
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert forward(ids, ids, [], batch).tolist() == [6, 8]
    assert not forward.active and "compiling failed" in caplog.text
    assert forward(-ids, ids, [], batch).tolist() == [-4, -5]


def test_the_cache_is_per_isa_cap(monkeypatch):
    """A graph compiled under make test-avx2's caps and loaded without them corrupted the heap on its first call:
    each cap compiles into its own directory."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = host_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert host_key() != native and host_key().endswith("aten-avx2")
