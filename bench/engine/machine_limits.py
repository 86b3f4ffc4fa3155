"""How far decode steps and a cold prefill are from this machine's limits (issue 25's targets).

    python -m bench.engine.machine_limits [--model default] [--gguf-weights blocks] [--threads 2] [--dtype auto]
                                          [--steps 40] [--prefill 1000]
                                          [--streams 1 8] [--compile-step 1 0] [--batch-invariant 1]

1. The machine: copy bandwidth (a 512 MiB tensor copied, read + write bytes / time) and the matmul peak
   (a 2048 x 2048 x 2048 GEMM in float32 and, where oneDNN runs it, bfloat16), medians of several.
2. The model as the engine loaded it (--model, default SmolLM2, `dtype`): the bytes of weights one decode step reads
   (each linear by the path it takes at 1 row: 4-bit or 8-bit groups, a packed bf16 / float32 weight; the
   embedding's one row) and the FLOPs of a decode token and of a --prefill-token cold prompt.
3. Measured, per engine mode (--compile-step): the median Engine.step() of N concurrent decode streams and
   the cold prefill's time. Floors: decode max(bytes / bandwidth, N x FLOPs / peak), prefill FLOPs / peak;
   each line gives measured / floor beside the target (decode 2x, prefill 1.2x).
Prints the CPU's ISA level and flags first. Under the AVX2 cap: `TETHER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2` (make test-avx2's settings), which caps the peaks measured here too.
"""

import argparse
import statistics
import time

import torch

from bench.common import host_line, median_seconds
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine
from replicas.kernels.cpu_linear import PackedLinear
from replicas.kernels.cpu_linear.gguf_blocks import GGUFEmbedding, GGUFLinear
from replicas.kernels.cpu_linear.int4 import Int4Linear
from replicas.kernels.cpu_linear.int8_native import Int8Linear
from replicas.kernels.cpu_linear.invariant_native import (InvariantBf16WeightLinear, InvariantInt8Linear,
                                                          InvariantLinear)

TARGETS = {"decode": 2.0, "prefill": 1.2}  # measured / floor, issue 25


def copy_bandwidth() -> float:
    """bytes/s: read + write of a 512 MiB float32 copy."""
    src, dst = torch.empty(128 << 20), torch.empty(128 << 20)
    src.fill_(1.0)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), samples=7)


def matmul_peak(dtype: torch.dtype) -> float | None:
    """FLOP/s of a 2048^3 GEMM, or None where the dtype's matmul fails."""
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    try:
        return 2 * 2048 ** 3 / median_seconds(lambda: a @ b, samples=5)
    except RuntimeError:
        return None


def decode_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode row reads: every linear by its 1-row path, plus one embedding row."""
    wrapped = {id(m.dense) for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))}
    total = sum(linear_bytes(m) for m in model.modules() if id(m) not in wrapped)
    embed = model.model.embed_tokens
    if isinstance(embed, GGUFEmbedding):  # one row of its blocks
        return total + embed.table.nbytes() // embed.num_embeddings
    return total + embed.weight.shape[1] * embed.weight.element_size()


def linear_bytes(module: torch.nn.Module) -> int:
    """What `module` reads for one row if it is a linear layer (its own, not its children's), else 0."""
    if isinstance(module, GGUFLinear):
        return module.nbytes()
    if isinstance(module, Int4Linear):
        return nbytes(*module.int4_buffers())
    if isinstance(module, Int8Linear):
        return nbytes(*module.int8_buffers())
    if isinstance(module, InvariantLinear):
        return nbytes(module.q4, module.scale4, module.offset4) if module.q4 is not None else nbytes(module.weight)
    if isinstance(module, InvariantInt8Linear):
        return nbytes(module.q, module.scale)
    if isinstance(module, InvariantBf16WeightLinear):
        return nbytes(module.packed)
    if isinstance(module, (PackedLinear, torch.nn.Linear)):
        return module.in_features * module.out_features * module.weight.element_size()
    return 0


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flops_per_token(config, context: int) -> float:
    """Linears (2 x weights) + attention over `context` keys (4 x heads x head_dim x keys) per layer."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return 2.0 * (layers * linear + hidden * config.vocab_size) + layers * 4.0 * heads * head_dim * context


def decode_step_time(engine: Engine, streams: int, steps: int) -> float:
    """The median step of `streams` concurrent greedy decodes of 100-token prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(streams):
        engine.add_request(GenerateRequest(f"decode{streams}-{i}", list(range(100 + i, 200 + i)), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request in list(engine.scheduler.running):
        engine.abort_request(request.request_id)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def prefill_time(engine: Engine, num_tokens: int, reps: int = 3) -> float:
    times = []
    for rep in range(reps + 1):
        ids = [(7919 * (i + 1) * (rep + 3)) % 40000 + 100 for i in range(num_tokens)]  # a new prompt each time
        engine.add_request(GenerateRequest(f"prefill{rep}", ids, SamplingParams(temperature=0.0, max_tokens=1)))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="a model spec (model_files/prepare.py)")
    parser.add_argument("--gguf-weights", choices=["blocks", "dequantized"], default="blocks",
                        help="engine.gguf_weights: a GGUF's blocks kept, or expanded at load (the layout before)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prefill", type=int, default=1000)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--compile-step", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    parser.add_argument("--batch-invariant", type=int, choices=[0, 1], default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{host_line()}; {args.threads} threads")
    bandwidth = copy_bandwidth()
    peaks = {dt: matmul_peak(dt) for dt in (torch.float32, torch.bfloat16)}
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; matmul peak " +
          ", ".join(f"{str(dt)[6:]} {p / 1e9:.0f} GFLOP/s" for dt, p in peaks.items() if p))
    for compiled in args.compile_step:
        engine = Engine(EngineConfig(model=str(prepare_model(args.model, progress=False)), dtype=args.dtype,
                                     gguf_weights=args.gguf_weights,
                                     enable_prefix_caching=False, compile_step=bool(compiled),
                                     batch_invariant=bool(args.batch_invariant)))
        report(engine, args, bandwidth, peaks[engine.dtype] or peaks[torch.float32])


def report(engine: Engine, args, bandwidth: float, peak: float) -> None:
    config, dtype = engine.model_config, str(engine.dtype)[6:]
    forward = engine.runner.forward
    mode = f"compiled step ({forward.compile_seconds:.1f} s to compile)" if getattr(forward, "compiled", False) \
        else "eager step"
    weight_bytes = decode_bytes(engine.model)
    print(f"\n{dtype}, {mode}, batch invariant {bool(engine.model.batch_invariant)}: "
          f"{weight_bytes / 1e6:.1f} MB of weights per decode step")
    for streams in args.streams:
        step = decode_step_time(engine, streams, args.steps)
        memory, compute = weight_bytes / bandwidth, streams * flops_per_token(config, 100) / peak
        floor = max(memory, compute)
        print(f"decode, {streams} stream(s): floor {floor * 1e3:.2f} ms (bandwidth {memory * 1e3:.2f}, compute "
              f"{compute * 1e3:.2f}); measured {step * 1e3:.2f} ms/step ({streams / step:.1f} tok/s): "
              f"{step / floor:.2f}x the floor, target {TARGETS['decode']}x")
    flops = sum(flops_per_token(config, i) for i in range(args.prefill)) - \
        (args.prefill - 1) * 2.0 * config.hidden_size * config.vocab_size  # the head runs on the last row only
    measured = prefill_time(engine, args.prefill)
    print(f"prefill, {args.prefill} tokens cold: {flops / 1e9:.1f} GFLOP; floor {flops / peak * 1e3:.0f} ms at "
          f"the {dtype} peak; measured {measured * 1e3:.0f} ms ({flops / measured / 1e9:.0f} GFLOP/s): "
          f"{measured / (flops / peak):.2f}x the floor, target {TARGETS['prefill']}x")


if __name__ == "__main__":
    main()
