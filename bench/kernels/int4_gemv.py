"""The native int4 kernel (replicas/kernels/cpu_linear/int4_native.py) against dense F.linear and torch's
int4 kernel at SmolLM2-135M's linear shapes, decode-sized batches.

    python -m bench.kernels.int4_gemv [--threads 2] [--iters 300] [--layers 30]
    TETHER_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.kernels.int4_gemv   # the AVX2 host's build

Two tables, each cell the fastest of 5 timings, the columns taking turns (on a shared host other work only
slows a timing, and a spell of it slows every column alike):
- in cache: one weight per shape, called again and again (µs per call);
- model-sized: --layers copies of every weight, a "step" calling each layer's four linears in turn so
  that weights come from memory as in a real decode step: ms per step and the effective GB/s of the
  weight bytes each kernel reads (native: 0.5 byte/weight + float32 scale and offset per group of 32).
Columns: native int4 with float32 and bf16 activations (float32 scales / offsets), and with float32
activations and float16 scales / offsets (exact for GGUF's, 0.625 byte/weight); dense float32 and bf16
F.linear; torch's `_weight_int4pack_mm_for_cpu` (one pass, bf16 activations and bf16 scales).
"""

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import host_line
from replicas.kernels.cpu_linear.int4_native import exact_half_scales, int4_linear, native_int4, pack_int4

# SmolLM2-135M: (N, K) of each layer's linears, in a decoder layer's order
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
G = 32
ROWS = (1, 2, 4, 8)
KINDS = ("int4 fp32", "int4 bf16", "int4 fp32 f16-scales", "F.linear fp32", "F.linear bf16", "torch int4 bf16")


def timed(fns: dict, iters: int) -> dict:
    """name -> fn  ->  name -> seconds per call: the fastest of 5 timings of `iters` calls, the
    functions taking turns (so that a spell of other work on the host slows all alike)."""
    for fn in fns.values():
        for _ in range(max(3, iters // 10)):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(5):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return best


class Weights:
    """One (N, K) weight in every form the columns use, and the bytes each reads per call."""

    def __init__(self, n: int, k: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        # [N, K/G] float32 each, float16 values as GGUF's (so that the f16-scales column applies)
        self.scale = (torch.rand(n, k // G, generator=g) * 0.02 + 1e-3).half().float()
        self.offset = (-torch.rand(n, k // G, generator=g) * 0.1).half().float()
        self.half_scales = exact_half_scales(self.scale, self.offset)
        self.packed = pack_int4(q)  # [N, K/2] uint8, rows in quads
        w = (q.view(n, k // G, G) * self.scale[..., None] + self.offset[..., None]).view(n, k)
        self.fp32, self.bf16 = w, w.bfloat16()  # [N, K]
        zero = self.offset + 8 * self.scale  # torch's form: (q - 8) * scale + zero
        self.tpacked = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        self.scale_zero = torch.stack([self.scale.t(), zero.t()], -1).contiguous().bfloat16()  # [K/G, N, 2]
        self.bytes = {"int4 fp32": n * k // 2 + 2 * 4 * n * k // G, "F.linear fp32": 4 * n * k,
                      "F.linear bf16": 2 * n * k, "torch int4 bf16": n * k // 2 + 2 * 2 * n * k // G}
        self.bytes["int4 bf16"] = self.bytes["int4 fp32"]
        self.bytes["int4 fp32 f16-scales"] = n * k // 2 + 2 * 2 * n * k // G

    def call(self, kind: str, x32: torch.Tensor, x16: torch.Tensor) -> torch.Tensor:
        if kind == "int4 fp32":
            return int4_linear(x32, self.packed, self.scale, self.offset, G)
        if kind == "int4 bf16":
            return int4_linear(x16, self.packed, self.scale, self.offset, G)
        if kind == "int4 fp32 f16-scales":
            return int4_linear(x32, self.packed, *self.half_scales, G)
        if kind == "F.linear fp32":
            return F.linear(x32, self.fp32)
        if kind == "F.linear bf16":
            return F.linear(x16, self.bf16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x16, self.tpacked, G, self.scale_zero)


def inputs(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, k)
    return x, x.bfloat16()


def in_cache(iters: int) -> None:
    print("\nIn cache: µs per call\n")
    print(f"| weight [N, K] | rows | {' | '.join(KINDS)} |\n|---|---|{'---|' * len(KINDS)}")
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        w = Weights(n, k, seed=i)
        for rows in ROWS:
            x32, x16 = inputs(rows, k)
            seconds = timed({kind: (lambda kind=kind: w.call(kind, x32, x16)) for kind in KINDS}, iters)
            print(f"| {name} [{n}, {k}] | {rows} | {' | '.join(f'{seconds[kind] * 1e6:.1f}' for kind in KINDS)} |",
                  flush=True)


def model_sized(layers: int, iters: int) -> None:
    print(f"\nModel-sized: {layers} copies of each weight, one step = every layer's 4 linears: "
          "ms per step (effective GB/s of weight bytes)\n")
    model = [[Weights(n, k, seed=100 * layer + i) for i, (n, k) in enumerate(SHAPES.values())]
             for layer in range(layers)]
    weight_mb = {kind: sum(w.bytes[kind] for ws in model for w in ws) / 1e6 for kind in KINDS}
    print(f"| rows | {' | '.join(f'{kind} ({weight_mb[kind]:.0f} MB)' for kind in KINDS)} |\n"
          f"|---|{'---|' * len(KINDS)}")
    for rows in ROWS:
        xs = {k: inputs(rows, k) for k in {k for _, k in SHAPES.values()}}

        def step(kind: str) -> None:
            for ws in model:
                for w in ws:
                    w.call(kind, *xs[w.fp32.shape[1]])

        seconds = timed({kind: (lambda kind=kind: step(kind)) for kind in KINDS}, iters)
        cells = [f"{seconds[kind] * 1e3:.2f} ({weight_mb[kind] / 1e3 / seconds[kind]:.1f})" for kind in KINDS]
        print(f"| {rows} | {' | '.join(cells)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300, help="calls per timing in cache")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_int4() is None:
        raise SystemExit("the native int4 kernel could not be built here (see the warning above)")
    print(f"{host_line()}; threads: {torch.get_num_threads()} (the native kernel runs on torch's OpenMP threads)")
    in_cache(args.iters)
    model_sized(args.layers, max(3, args.iters // 100))


if __name__ == "__main__":
    main()
