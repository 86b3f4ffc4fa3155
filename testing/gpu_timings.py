"""The GPU check's measurements (bench/gpu/gpu_check.py runs them on CUDA, by hand): each takes a device and
returns rows of timings, at the shapes in this module's constants, which tests/unit/test_gpu_check.py shrinks
to run every one on CPU (the Triton kernels under Triton's interpreter), so that none can rot unseen.

- timings: one linear-attention layer of Qwen3.5 shape (bf16), a 4k-token prefill (chunk_gated_delta_rule) and
  a 64-sequence decode step (fused_recurrent_gated_delta_rule), the PyTorch reference against the dispatcher;
- attention_timings: the paged decode attention kernel against the PyTorch group path it replaces, at batch 1,
  16 and 64 of a ~1B Llama attention shape, with the KV bytes read per second;
- sampling_timings: the row-sampling kernel against its reference at 64 rows x 152k vocabulary;
- engine_timings: engine decode steps of a ~1B random-weight model of each family, with the weight bytes read
  per second; peak_gbps: the device's peak bandwidth the tables compare against.
"""

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# HBM bandwidth in GB/s by a substring of torch.cuda.get_device_name() (vendor datasheets); first match wins.
PEAK_GBPS = [("GH200", 4000), ("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
             ("A100-SXM4-80GB", 2039), ("A100", 1555), ("L40", 864), ("L4", 300)]


@dataclass
class Case:
    name: str
    num_seqs: int
    tokens_per_seq: int
    H: int = 16  # Qwen3.5-style linear attention: 16 key heads, 32 value heads, 128-dim heads
    HV: int = 32
    K: int = 128
    V: int = 128


CASES = [Case("prefill 4k tokens", 1, 4096), Case("decode 64 sequences", 64, 1)]


def inputs(case: Case, device: str, dtype=torch.bfloat16) -> dict:
    T = case.num_seqs * case.tokens_per_seq
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    cu_seqlens = torch.arange(0, T + 1, case.tokens_per_seq, dtype=torch.int64, device=device)
    return dict(q=rand(1, T, case.H, case.K), k=rand(1, T, case.H, case.K), v=rand(1, T, case.HV, case.V),
                g=-torch.rand(1, T, case.HV, generator=g).to(device=device, dtype=torch.float32),
                beta=torch.rand(1, T, case.HV, generator=g).to(device=device, dtype=dtype),
                initial_state=torch.zeros(case.num_seqs, case.HV, case.K, case.V, device=device),
                output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)


def time_ms(fn, repeats: int = 5) -> float:
    """Mean wall ms of fn over repeats, after one warm-up call (compiles the kernels), with CUDA synchronized."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def timings(device: str) -> list[tuple[str, float, float]]:
    from replicas.kernels.gated_delta_rule import (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                                   naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule)

    rows = []
    for case in CASES:
        args = inputs(case, device)
        if case.tokens_per_seq > 1:
            ref, fast = naive_chunk_gated_delta_rule, chunk_gated_delta_rule
        else:
            ref, fast = naive_recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule
        rows.append((case.name, time_ms(lambda: ref(**args)), time_ms(lambda: fast(**args))))
    return rows


@dataclass
class AttentionCase:
    num_seqs: int
    context_len: int = 2048
    H: int = 32  # Llama 3.2 1B: 32 query heads, 8 KV heads, 64-dim heads
    HKV: int = 8
    D: int = 64
    block_size: int = 16


ATTENTION_CASES = [AttentionCase(1), AttentionCase(16), AttentionCase(64)]
KERNEL_REPEATS = 20


def attention_inputs(case: AttentionCase, device: str, dtype=torch.bfloat16) -> dict:
    """A decode group of num_seqs sequences of context_len keys each, blocks scattered over the pool."""
    from replicas.kernels.paged_attention import AttentionGroup

    B, L, bs = case.num_seqs, case.context_len, case.block_size
    g = torch.Generator(device="cpu").manual_seed(0)
    num_blocks = B * -(-L // bs)
    block_tables = torch.randperm(num_blocks, generator=g).view(B, -1).to(device=device, dtype=torch.int32)
    context_lens = torch.full((B,), L, dtype=torch.int32, device=device)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    group = AttentionGroup(torch.arange(B, device=device)[:, None], torch.ones(B, 1, dtype=torch.bool, device=device),
                           torch.ones(B, 1, 1, L, dtype=torch.bool, device=device), block_tables, context_lens)
    return dict(q=rand(B, case.H, case.D), k_cache=rand(num_blocks, bs, case.HKV, case.D),
                v_cache=rand(num_blocks, bs, case.HKV, case.D), group=group, scale=case.D ** -0.5)


def attention_timings(device: str) -> list[tuple[str, float, float, float]]:
    """(case, reference ms, kernel ms, kernel GB/s of KV read) per case. Reference: naive_paged_attention over
    the group (gather + matmuls), the path the kernel replaces."""
    from replicas.kernels.paged_attention import naive_paged_attention
    from replicas.kernels.paged_attention.triton_decode import paged_decode_attention

    rows = []
    for case in ATTENTION_CASES:
        x = attention_inputs(case, device)
        q, k_cache, v_cache, group, scale = x["q"], x["k_cache"], x["v_cache"], x["group"], x["scale"]
        ref_ms = time_ms(lambda: naive_paged_attention(q, k_cache, v_cache, [group], scale), KERNEL_REPEATS)
        fast_ms = time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, group.block_tables, group.context_lens,
                                                         scale), KERNEL_REPEATS)
        kv_bytes = 2 * case.num_seqs * case.context_len * case.HKV * case.D * k_cache.element_size()
        rows.append((f"decode B={case.num_seqs} ctx={case.context_len}", ref_ms, fast_ms, kv_bytes / fast_ms / 1e6))
    return rows


SAMPLING_SHAPE = (64, 151936)  # rows, vocabulary (Qwen's)


def sampling_timings(device: str) -> list[tuple[str, float, float, float]]:
    """(case, reference ms, kernel ms, kernel GB/s read) for all-greedy and all-drawn rows."""
    from replicas.kernels.sampling.naive import naive_sample_rows
    from replicas.kernels.sampling.triton_sample import sample_rows

    R, V = SAMPLING_SHAPE
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (4 * torch.randn(R, V, generator=g)).to(device)
    noise = torch.rand(R, V, generator=g).clamp_(1e-12, 1 - 1e-7).to(device)
    rows = []
    for name, t, num_inputs in (("greedy", 0.0, 1), ("drawn", 0.8, 2)):  # drawn rows read logits and noise
        temperature = torch.full((R,), t, device=device)
        ref_ms = time_ms(lambda: naive_sample_rows(logits, temperature, noise), KERNEL_REPEATS)
        fast_ms = time_ms(lambda: sample_rows(logits, temperature, noise), KERNEL_REPEATS)
        rows.append((f"sample {R}x{V} {name}", ref_ms, fast_ms, num_inputs * R * V * 4 / fast_ms / 1e6))
    return rows


# ~1B random-weight models on the default model's tokenizer (vocabulary 49152): Llama 3.2 1B's body, and a
# Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1 gated full-attention layer).
ENGINE_MODELS = {
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3.5-hybrid-1b": ("qwen3_5", dict(hidden_size=2048, intermediate_size=4096, num_hidden_layers=24,
                                          layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
                                          num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                          linear_num_key_heads=16, linear_num_value_heads=16,
                                          linear_key_head_dim=128, linear_value_head_dim=128)),
}
ENGINE_BATCHES = [1, 16, 64]
PROMPT_LEN, DECODE_STEPS = 128, 10


def make_checkpoint(family: str, overrides: dict, out_dir: Path, tokenizer_dir: Path) -> Path:
    """The tests' random-weight checkpoint writers (testing/tiny_models.py, testing/tiny_hybrid.py) at other sizes."""
    from testing.tiny_hybrid import make_tiny_qwen3_5
    from testing.tiny_models import make_tiny_llama

    make = make_tiny_qwen3_5 if family == "qwen3_5" else make_tiny_llama
    return make(out_dir, tokenizer_dir, **overrides)


def engine_timings(device: str, dtype: str = "bfloat16") -> list[tuple[str, int, float, float]]:
    """(model, batch, ms per decode step, weight GB/s) for each ENGINE_MODELS entry and ENGINE_BATCHES size:
    the wall time of Engine.step() over DECODE_STEPS decode steps, prompts already prefilled."""
    from core.engine_config import EngineConfig
    from core.messages import GenerateRequest, SamplingParams
    from model_files.prepare import prepare_model
    from replicas.engine.engine import Engine

    tokenizer_dir = prepare_model("default", progress=False)
    rows = []
    for name, (family, overrides) in ENGINE_MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_checkpoint(family, overrides, Path(tmp), tokenizer_dir)
            max_seqs = max(ENGINE_BATCHES)
            blocks_per_seq = -(-(PROMPT_LEN + DECODE_STEPS + 16) // 16) + 1
            engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device=device, max_num_seqs=max_seqs,
                                         max_num_batched_tokens=max(2048, max_seqs), block_size=16,
                                         num_kv_blocks=max_seqs * blocks_per_seq, enable_prefix_caching=False))
            weight_bytes = engine.memory["num_weight_bytes"]
            params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 16, ignore_eos=True)
            for batch in ENGINE_BATCHES:
                for i in range(batch):
                    prompt = [(7 * i + j) % 1000 + 100 for j in range(PROMPT_LEN)]
                    engine.add_request(GenerateRequest(f"{name}-{batch}-{i}", prompt, params))
                while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                      for r in engine.scheduler.running):
                    engine.step()  # prefill
                step_ms = time_ms(engine.step, repeats=DECODE_STEPS)  # max_tokens leaves room for all of them
                for request in list(engine.scheduler.running):
                    engine.abort_request(request.request_id)
                while engine.has_unfinished():
                    engine.step()
                rows.append((name, batch, step_ms, weight_bytes / step_ms / 1e6))
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def peak_gbps() -> float | None:
    """GPU_PEAK_GBPS, else the PEAK_GBPS entry matching this device's name, else None."""
    if os.environ.get("GPU_PEAK_GBPS"):
        return float(os.environ["GPU_PEAK_GBPS"])
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def print_kernel_table(title: str, rows: list[tuple[str, float, float, float]], peak: float | None) -> None:
    print(f"\n{title:32}{'reference ms':>14}{'kernel ms':>12}{'speed-up':>10}{'GB/s':>9}{'of peak':>9}")
    for name, ref_ms, fast_ms, gbps in rows:
        share = f"{gbps / peak:.0%}" if peak else "unknown"
        print(f"{name:32}{ref_ms:>14.3f}{fast_ms:>12.3f}{ref_ms / fast_ms:>10.1f}{gbps:>9.0f}{share:>9}")
