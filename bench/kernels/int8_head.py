"""µs per call of the LM head [49152, 576] at 1 and 8 rows: the native int8 kernel vs F.linear float32 vs
the packed float32 (mkldnn) head, and the native kernel's error against float64.

    python -m bench.kernels.int8_head [--threads 2] [--seconds 0.6]

Each cell: the median and the fastest of the calls that fit in --seconds, after 3 warm-up calls.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from replicas.kernels.cpu_linear.int8_native import eight_bit_groups, native_int8

N, K, G = 49152, 576, 32


def median_us(fn, seconds: float) -> tuple[float, float]:
    """(median, fastest) µs per call of fn."""
    for _ in range(3):
        fn()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, min(times) * 1e6


def head_weights(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values, their float32 scale per group of G, and the float32 weight they make."""
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = (torch.rand(N, K // G, generator=g) * 0.01 + 1e-4).half().float()
    w = (q.view(N, -1, G).float() * scale[..., None]).view(N, K)
    assert eight_bit_groups(w) is not None
    return q, scale, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.6, help="time per cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, scale, w = head_weights(g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    mod = native_int8()
    for m in (1, 8):
        x = torch.randn(m, K, generator=g)
        out = torch.empty(m, N)
        ref = x.double() @ w.double().T
        mod.int8_linear(x, q, scale, G, out)
        got = out
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        for name, fn in [("native int8", lambda: mod.int8_linear(x, q, scale, G, out)),
                         ("F.linear f32", lambda: F.linear(x, w)),
                         ("packed f32", lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))]:
            med, best = median_us(fn, args.seconds)
            print(f"[{m}, {K}] x [{N}, {K}]  {name:13s} median {med:7.0f} us  min {best:7.0f} us", flush=True)
        print(f"  native max |err| / max |ref| = {err:.1e}")


if __name__ == "__main__":
    main()
