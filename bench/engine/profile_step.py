"""Where a step's time goes: torch.profiler over engine steps, the top operators by self time.

    python -m bench.engine.profile_step [--model default] [--dtype auto] [--streams 1 8] [--steps 20]
                                        [--prefill 100 1000]

For each batch size: warms up, then profiles --steps decode steps of that many
concurrent greedy streams (prompts already prefilled) and prints the wall time per
step, the share of it spent inside torch operators, a line per step phase
(replicas/engine/phases.py: schedule, build, forward, sample, output; each phase's wall
time per step and the part of it inside torch operators) and the top operators by self
CPU time. With --prefill, profiles instead the cold prefill of prompts of those
lengths (prefix caching off), up to the first token, over --steps prompts.
"""

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine
from replicas.engine.phases import PHASES

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


def decode_steps(engine: Engine, streams: int, steps: int, prompt_ids: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(streams):
        engine.add_request(GenerateRequest(f"p{streams}-{i}-{time.perf_counter_ns()}", prompt_ids, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill


def profile_prefill(engine: Engine, num_tokens: int, steps: int, top: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    vocab = engine.model_config.vocab_size

    def prompt(i: int) -> list[int]:
        return [(7 + 31 * (i * num_tokens + j)) % vocab for j in range(num_tokens)]

    def first_token(i: int) -> None:
        engine.add_request(GenerateRequest(f"prefill-{num_tokens}-{i}-{time.perf_counter_ns()}", prompt(i), params))
        while engine.has_unfinished():
            engine.step()

    first_token(-1)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            first_token(i)
        wall = (time.perf_counter() - start) / steps
    print(f"\ncold prefill of {num_tokens} tokens, {str(engine.dtype).removeprefix('torch.')}: "
          f"{wall * 1e3:.1f} ms to the first token")
    print_top(prof, steps, wall, top)


def print_top(prof, steps: int, wall: float, top: int) -> None:
    events = prof.key_averages()
    labels = {f"step.{name}" for name in PHASES}
    in_ops = sum(e.self_cpu_time_total for e in events if e.key not in labels) / steps / 1e6
    print(f"{in_ops * 1e3:.1f} ms inside torch ops, {(wall - in_ops) * 1e3:.1f} ms outside")
    print_phases(prof, steps, wall)
    print(f"{'operator':40}{'self ms/step':>13}{'calls/step':>12}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.key[:40]:40}{e.self_cpu_time_total / steps / 1e3:>13.2f}{e.count / steps:>12.0f}")


def print_phases(prof, steps: int, wall: float) -> None:
    """Per phase: wall ms per step (the range's CPU time: one thread runs the step) and the ms of it inside
    torch operators; `other` is the step's time outside every phase."""
    totals = {name: 0.0 for name in PHASES}
    in_ops = {name: 0.0 for name in PHASES}
    for event in prof.events():
        if event.name.startswith("step."):
            totals[event.name[5:]] += event.cpu_time_total / 1e3
            in_ops[event.name[5:]] += sum(child.cpu_time_total for child in event.cpu_children) / 1e3
    line = ", ".join(f"{name} {totals[name] / steps:.2f} ({in_ops[name] / steps:.2f} in ops)" for name in PHASES)
    other = wall * 1e3 - sum(totals.values()) / steps
    print(f"phases, ms per step: {line}, other {other:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--prefill", type=int, nargs="*", default=[])
    parser.add_argument("--int4-decode", type=int, choices=[0, 1], default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(prepare_model(args.model, progress=False)), dtype=args.dtype,
                                 enable_prefix_caching=not args.prefill, int4_decode=bool(args.int4_decode)))
    for num_tokens in args.prefill:
        profile_prefill(engine, num_tokens, args.steps, args.top)
    if args.prefill:
        return
    prompt_ids = engine.tokenizer.encode(PROMPT)
    for streams in args.streams:
        decode_steps(engine, streams, args.steps, prompt_ids)
        for _ in range(3):
            engine.step()  # warm-up at this batch size
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            wall = (time.perf_counter() - start) / args.steps
        for request in list(engine.scheduler.running):
            engine.abort_request(request.request_id)
        while engine.has_unfinished():
            engine.step()
        print(f"\n{streams} stream(s), {str(engine.dtype).removeprefix('torch.')}, {args.threads} threads: "
              f"{wall * 1e3:.1f} ms per decode step ({streams / wall:.1f} tok/s)")
        print_top(prof, args.steps, wall, args.top)


if __name__ == "__main__":
    main()
