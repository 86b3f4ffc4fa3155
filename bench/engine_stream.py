"""Decode through the replica's own path: AsyncEngine in-process, no HTTP. Side by side with another checkout.

    python bench/engine_stream.py [--tree DIR] [--threads 2] [--tokens 128] [--runs 3]

Streams --tokens greedy tokens (ignore_eos) through `AsyncEngine.generate`, as a ModelReplica does: 1 stream
(decode tok/s, first -> last token) and 8 concurrent streams (aggregate tok/s, submission -> last token,
prefill included; 8 different chat prompts). --tree imports Tether from another checkout (a git worktree
of an older commit: `git worktree add /tmp/old <rev>`), so the two can be timed alternately on a noisy
machine. Before e0eb31b AsyncEngine took a built Engine; that form is used when the checkout has it.
"""

import argparse
import asyncio
import inspect
import statistics
import sys
import time
from pathlib import Path


def start_engine(threads: int):
    import torch

    from core.engine_config import EngineConfig
    from replicas.engine.async_engine import AsyncEngine
    from replicas.engine.engine import Engine
    from model_files.prepare import prepare_model

    config = EngineConfig(model=str(prepare_model("default", progress=False)))
    if "build_engine" in inspect.signature(AsyncEngine.__init__).parameters:
        return AsyncEngine(lambda: Engine(config), threads)
    torch.set_num_threads(threads)  # older checkouts: built on this thread, stepped on the engine's
    return AsyncEngine(Engine(config))


async def stream(engine, prompt: list[int], tokens: int) -> list[float]:
    from core.messages import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stamps = []
    async for delta in engine.generate(GenerateRequest(f"s{time.perf_counter_ns()}", prompt, params)):
        stamps += [time.perf_counter()] * len(delta.token_ids)
    return stamps


async def one_run(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    single = await stream(engine, prompts[0], tokens)
    start = time.perf_counter()
    many = await asyncio.gather(*(stream(engine, p, tokens) for p in prompts))
    aggregate = sum(len(s) for s in many) / (max(s[-1] for s in many) - start)
    return (len(single) - 1) / (single[-1] - single[0]), aggregate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    from bench.throughput import QUESTIONS  # after --tree is on the path: it imports that tree's engine

    engine = start_engine(args.threads)
    tokenizer = engine.engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    runs = [asyncio.run(one_run(engine, prompts, args.tokens)) for _ in range(args.runs)]
    engine.shutdown()
    print(f"{args.tree}: 1 stream {statistics.median(r[0] for r in runs):.1f} tok/s "
          f"({', '.join(f'{r[0]:.1f}' for r in runs)}); 8 streams {statistics.median(r[1] for r in runs):.1f} tok/s "
          f"({', '.join(f'{r[1]:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
