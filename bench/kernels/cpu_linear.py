"""F.linear vs PackedLinear (replicas/kernels/cpu_linear) at SmolLM2-135M's shapes, on this CPU.

    python -m bench.kernels.cpu_linear [--threads 2] [--iters 200]

For each weight shape (q/k/v merged, gate/up merged, down, the LM head) and batch size (rows: 1 and 8 for
decode, 512 for a prefill chunk), the median of 5 timings of --iters calls each, both in bfloat16 and, for
the head, in float32 (Tether keeps the head in float32 under bf16 weights).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import median_seconds
from replicas.kernels.cpu_linear import PackedLinear

SHAPES = {"qkv_proj": (960, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536), "lm_head": (49152, 576)}


def timed(fn, iters: int) -> float:
    return median_seconds(fn, samples=5, iters=iters, warmup=max(3, iters // 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| weight | dtype | rows | F.linear (us) | packed (us) | speed-up |\n|---|---|---|---|---|---|")
    for name, (out_features, in_features) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32) if name == "lm_head" else (torch.bfloat16,):
            linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
            packed = PackedLinear(linear)
            for rows in (1, 8, 512):
                iters = max(2, args.iters // (rows if name == "lm_head" else max(1, rows // 8)))
                x = torch.randn(rows, in_features, dtype=dtype)
                plain = timed(lambda: F.linear(x, linear.weight), iters)
                fast = timed(lambda: packed(x), iters)
                print(f"| {name} [{in_features}, {out_features}] | {str(dtype).removeprefix('torch.')} | {rows} "
                      f"| {plain * 1e6:.0f} | {fast * 1e6:.0f} | {plain / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
