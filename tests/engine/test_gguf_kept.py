"""GGUF weights kept in their block formats by the engine (replicas/models/gguf_loader.py):
- files with the widths, vocabulary and type mixtures of a real 1B model (Llama-3.2-1B's shape, two layers; the
  types llama.cpp's Q4_K_M / Q5_K_M / Q6_K / Q8_0 give each tensor, bench/models/shaped_gguf.py) load with every
  matrix kept in its type, the layers holding the file's bytes, the process growing by at most 1.3x the file
  while the weights load (the phase's peak RSS; before it, imports and the GGUF's index, after it the rotary
  tables, neither growing with the file), and serve (Q4_K_M, in bf16);
- token for token and logprob for logprob, a kept file generates what its float32 conversion (the gguf
  package's dequantize of the same bytes) generates, in float32 with batch invariance on; so does the file
  expanded at load (engine.gguf_weights: dequantized).
The kernels' own tests: tests/kernels/test_gguf_blocks.py; every family and type against transformers:
tests/parity/test_gguf_families.py."""

import collections

import pytest
import torch
from gguf import GGUFReader

from testing.shaped_gguf import write_gguf
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine
from replicas.kernels.cpu_linear.gguf_blocks import GGUFEmbedding, GGUFLinear, native_gguf
from replicas.models.gguf_loader import load_gguf_weights
from replicas.models.loader import load_model
from testing.tiny_gguf import T, write_tiny_gguf

pytestmark = pytest.mark.skipif(native_gguf() is None, reason="the GGUF block kernel is not built here")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def greedy(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    engine.add_request(GenerateRequest("g", prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                    ignore_eos=True, logprobs=0)))
    ids, logprobs = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            ids += delta.token_ids
            logprobs += [entry.logprob for entry in delta.logprobs or []]
    return ids, logprobs


@pytest.mark.parametrize("mixture", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_a_1b_shaped_file_loads_in_its_blocks_within_its_size(mixture, tmp_path, monkeypatch):
    path = tmp_path / f"llama-1b-{mixture}.gguf"
    write_gguf(path, "llama-1b", mixture, num_layers=2)
    file_types = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    model_dir = prepare_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    phase = {}

    def measured(*args, **kwargs):  # the weights' phase of load_model: its own peak, from its own start
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from here
        phase["before"] = rss_kib("VmRSS")
        phase["kept"] = load_gguf_weights(*args, **kwargs)
        phase["peak"] = rss_kib("VmHWM") - phase["before"]
        return phase["kept"]

    monkeypatch.setattr("replicas.models.loader.load_gguf_weights", measured)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), native=True, batch_invariant=True)
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    parts = [p for m in kept if m is not model.lm_head for p in m.parts.values()]
    table = model.model.embed_tokens.table
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.lm_head.parts["weight"] is table
    assert phase["kept"] == file_types  # every matrix kept, in its type
    assert {p.qtype.name for p in parts + [table]} == set(file_types)
    tensor_bytes = sum(t.n_bytes for t in GGUFReader(path).tensors if len(t.shape) == 2)
    assert sum(p.nbytes() for p in parts) + table.nbytes() == tensor_bytes  # the file's bytes, reordered
    assert phase["peak"] * 1024 <= 1.3 * path.stat().st_size, f"load peak {phase['peak'] / 1024:.0f} MiB"
    del model
    if mixture != "Q4_K_M":
        return  # serving one is enough: the layers are the same kind
    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=8, compile_step=False))
    ids, _ = greedy(engine, list(range(300, 340)), 4)
    assert len(ids) == 4


K_QUANT_MIXTURE = dict(token_embd=T.Q6_K, attn_q=T.Q4_K, attn_k=T.Q4_K, attn_v=T.Q6_K, attn_output=T.Q4_K,
                       ffn_gate=T.Q5_K, ffn_up=T.Q4_K, ffn_down=T.Q6_K, output=T.Q8_0)


def test_kept_blocks_generate_what_the_float32_conversion_generates(tmp_path):
    """The kernels rebuild each weight as the gguf package does and sum in the fixed order of the float32 linear:
    every token and logprob equal, over a chunked prefill and decode."""
    path = tmp_path / "k.gguf"
    write_tiny_gguf(path, "llama", K_QUANT_MIXTURE, seed=5, tied=False)
    config = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=32, compile_step=False)
    kept = Engine(EngineConfig(model=str(prepare_model(str(path), cache_dir=tmp_path, progress=False)), **config))
    dense = Engine(EngineConfig(model=str(prepare_model(str(path), cache_dir=tmp_path, progress=False,
                                                        float32=True)), **config))
    assert isinstance(kept.model.lm_head, GGUFLinear) and not isinstance(dense.model.lm_head, GGUFLinear)
    expanded = Engine(EngineConfig(model=str(prepare_model(str(path), cache_dir=tmp_path, progress=False)),
                                   gguf_weights="dequantized", **config))  # the GGUF expanded at load instead
    assert not any(isinstance(m, GGUFLinear) for m in expanded.model.modules())
    prompt = list(range(1000, 1070))
    ours, reference = greedy(kept, prompt, 24), greedy(dense, prompt, 24)
    assert ours == reference
    assert greedy(expanded, prompt, 24) == reference
    assert len(set(ours[0])) > 3  # not one token repeated
