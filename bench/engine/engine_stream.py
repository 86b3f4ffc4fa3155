"""Decode through the replica's own path: AsyncEngine in-process, no HTTP. Side by side with another checkout.

    python -m bench.engine.engine_stream [--threads 2] [--tokens 128] [--runs 3]

Streams --tokens greedy tokens (ignore_eos) through `AsyncEngine.generate`, as a ModelReplica does: 1 stream
(decode tok/s, first -> last token) and 8 concurrent streams (aggregate tok/s, submission -> last token,
prefill included; 8 different chat prompts). To time another commit against this one on a noisy machine, run
it in a worktree of that commit and here, alternately: `git worktree add /tmp/old <rev>`, then
`(cd /tmp/old && python -m bench.engine.engine_stream); python -m bench.engine.engine_stream` (`python -m`
puts the working directory first on the module path, so each run imports its own tree's Tether).
"""

import argparse
import asyncio
import os
import statistics
import time

from bench.common import QUESTIONS, chat_ids


def start_engine(threads: int):
    from core.engine_config import EngineConfig
    from model_files.prepare import prepare_model
    from replicas.engine.async_engine import AsyncEngine
    from replicas.engine.engine import Engine

    config = EngineConfig(model=str(prepare_model("default", progress=False)))
    return AsyncEngine(lambda: Engine(config), threads)


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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine = start_engine(args.threads)
    prompts = [chat_ids(engine.engine.tokenizer, q) for q in QUESTIONS]
    runs = [asyncio.run(one_run(engine, prompts, args.tokens)) for _ in range(args.runs)]
    engine.shutdown()
    print(f"{os.getcwd()}: 1 stream {statistics.median(r[0] for r in runs):.1f} tok/s "
          f"({', '.join(f'{r[0]:.1f}' for r in runs)}); 8 streams {statistics.median(r[1] for r in runs):.1f} tok/s "
          f"({', '.join(f'{r[1]:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
