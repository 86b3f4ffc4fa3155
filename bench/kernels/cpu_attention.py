"""naive_paged_attention (today's CPU path) vs the native kernel (replicas/kernels/paged_attention/cpu_native.py)
at SmolLM2-135M's attention shapes (9 query heads, 3 KV heads of 64, blocks of 16), on this CPU.

    python -m bench.kernels.cpu_attention [--threads 2] [--samples 7]

Per shape and dtype: the median over --samples timings of one layer's attention call (each timing averages
enough calls to last ~20 ms). The naive path gets its AttentionGroups from ModelRunner.prepare, as in the
engine (built once per step, shared by all layers, so not timed); the kernel gets the step's query_start_loc,
seq_lens and block_table. GFLOP/s counts 4 * D * H per visible (query, key) pair. A 1000-token prompt runs as
two chunks of 512 (the engine's chunked prefill), timed together.
"""

import argparse
import time

import torch

from bench.common import host_line, median_seconds
from core.messages import SamplingParams
from replicas.engine.model_runner import ModelRunner
from replicas.engine.scheduler import ScheduledRequest
from replicas.kernels.paged_attention.cpu_native import cpu_paged_attention, native_ops
from replicas.kernels.paged_attention.naive import naive_paged_attention
from replicas.request.request import Request

H, HKV, D, BLOCK = 9, 3, 64, 16
# name -> steps, each a list of (keys cached before the step, new tokens) per sequence
SHAPES = {
    "decode 1 x 400 keys": [[(399, 1)]],
    "decode 8 x 400 keys": [[(399, 1)] * 8],
    "decode 1 x 1000 keys": [[(999, 1)]],
    "prefill 512 cold": [[(0, 512)]],
    "prefill 1000 cold (2 chunks)": [[(0, 512)], [(512, 488)]],
    "turn 160 over 640 cached": [[(640, 160)]],
}


def step_inputs(seqs: list[tuple[int, int]], dtype: torch.dtype):
    """One step's inputs for both paths over a shared random cache with shuffled blocks.
    -> naive args (q, k_cache, v_cache, groups), native args (q, k_cache, v_cache, query_start_loc, seq_lens,
    block_table), visible (query, key) pairs"""
    lens = [cached + new for cached, new in seqs]
    num_blocks = sum(-(-length // BLOCK) for length in lens)
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D).to(dtype)  # [num_blocks, BLOCK, Hkv, D]
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks).tolist()
    scheduled = []
    for i, ((cached, new), length) in enumerate(zip(seqs, lens)):
        request = Request(f"s{i}", list(range(length)), SamplingParams(), 4, frozenset())
        request.block_table = [pool.pop() for _ in range(-(-length // BLOCK))]
        request.num_computed_tokens = cached
        scheduled.append(ScheduledRequest(request, new))
    batch = ModelRunner(None, [(k_cache, v_cache)], BLOCK, torch.device("cpu")).prepare(scheduled)
    tables = [s.request.block_table for s in scheduled]
    block_table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(new for _, new in seqs), H, D).to(dtype)  # [T, H, D]
    native = (q, k_cache, v_cache, batch.cu_seqlens.to(torch.int32), torch.tensor(lens, dtype=torch.int32),
              block_table)
    pairs = sum(sum(range(cached + 1, cached + new + 1)) for cached, new in seqs)
    return (q, k_cache, v_cache, batch.groups), native, pairs


def timed(fn, samples: int) -> float:
    """Median seconds per call, each timing averaging enough calls to last ~20 ms."""
    fn()
    start = time.perf_counter()
    fn()
    iters = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    return median_seconds(fn, samples, iters, warmup=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{host_line()}; torch threads: {torch.get_num_threads()}, torch {torch.__version__}")
    if native_ops() is None:
        raise SystemExit("the native op is unavailable here (see the warning above)")
    scale = D ** -0.5
    print("| shape | dtype | naive (us) | native (us) | speed-up | naive GFLOP/s | native GFLOP/s |\n"
          "|---|---|---|---|---|---|---|")
    for name, steps in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            inputs = [step_inputs(seqs, dtype) for seqs in steps]
            naive = timed(lambda: [naive_paged_attention(*n, scale) for n, _, _ in inputs], args.samples)
            native = timed(lambda: [cpu_paged_attention(*c, scale) for _, c, _ in inputs], args.samples)
            flops = 4 * D * H * sum(pairs for _, _, pairs in inputs)
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {naive * 1e6:.0f} | {native * 1e6:.0f} "
                  f"| {naive / native:.1f}x | {flops / naive / 1e9:.1f} | {flops / native / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
