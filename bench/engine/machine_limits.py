"""How far a one-stream decode step and a cold prefill are from this machine's limits.

    python -m bench.engine.machine_limits [--threads 2] [--dtype auto] [--steps 40] [--prefill 1000]

1. The machine: copy bandwidth (a 512 MiB tensor copied, read + write bytes / time) and the matmul peak
   (a 2048 x 2048 x 2048 GEMM in float32 and, where oneDNN runs it, bfloat16), medians of several.
2. The model as the engine loaded it (default SmolLM2, `dtype`): the bytes of weights one decode row reads
   (each linear by the path it takes at 1 row: the int4 groups, a packed bf16 / float32 weight; the
   embedding's one row) and the FLOPs of one decode token and of a --prefill-token cold prompt.
3. Measured: the engine's median one-stream Engine.step() and the cold prefill's time, and each floor:
   bytes / bandwidth (decode) and FLOPs / peak (prefill), as a fraction of the measured time.
Prints the CPU's ISA level and flags first.
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
from replicas.kernels.cpu_linear.int4 import Int4Linear


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
    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            total += sum(b.numel() * b.element_size() for b in module.int4_buffers())
        elif isinstance(module, (PackedLinear, torch.nn.Linear)) and not _inside_int4(model, module):
            total += module.in_features * module.out_features * module.weight.element_size()
    embed = model.model.embed_tokens.weight
    return total + embed.shape[1] * embed.element_size()


def _inside_int4(model, module) -> bool:
    return any(isinstance(m, Int4Linear) and m.dense is module for m in model.modules())


def flops_per_token(config, context: int) -> float:
    """Linears (2 x weights) + attention over `context` keys (4 x heads x head_dim x keys) per layer."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return 2.0 * (layers * linear + hidden * config.vocab_size) + layers * 4.0 * heads * head_dim * context


def decode_step_time(engine: Engine, steps: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request(GenerateRequest("decode", list(range(100, 200)), params))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prefill", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{host_line()}; {args.threads} threads")
    bandwidth = copy_bandwidth()
    peaks = {dt: matmul_peak(dt) for dt in (torch.float32, torch.bfloat16)}
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; matmul peak " +
          ", ".join(f"{str(dt)[6:]} {p / 1e9:.0f} GFLOP/s" for dt, p in peaks.items() if p))
    engine = Engine(EngineConfig(model=str(prepare_model("default", progress=False)), dtype=args.dtype,
                                 enable_prefix_caching=False))
    config = engine.model_config
    weight_bytes = decode_bytes(engine.model)
    step = decode_step_time(engine, args.steps)
    floor = weight_bytes / bandwidth
    print(f"decode, 1 stream ({engine.dtype}): {weight_bytes / 1e6:.1f} MB of weights per step; floor "
          f"{floor * 1e3:.2f} ms at copy bandwidth; measured {step * 1e3:.2f} ms/step "
          f"({1 / step:.1f} tok/s): the floor is {floor / step:.0%} of it")
    peak = peaks[engine.dtype] or peaks[torch.float32]
    flops = sum(flops_per_token(config, i) for i in range(args.prefill)) - \
        (args.prefill - 1) * 2.0 * config.hidden_size * config.vocab_size  # the head runs on the last row only
    measured = prefill_time(engine, args.prefill)
    print(f"prefill, {args.prefill} tokens cold: {flops / 1e9:.1f} GFLOP; floor {flops / peak * 1e3:.0f} ms at "
          f"the {str(engine.dtype)[6:]} peak; measured {measured * 1e3:.0f} ms ({flops / measured / 1e9:.0f} "
          f"GFLOP/s): the floor is {flops / peak / measured:.0%} of it")


if __name__ == "__main__":
    main()
