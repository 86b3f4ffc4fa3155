"""Sampling cost per step, isolated from the model: the Sampler on logits of a batch of rows.

    python -m bench.kernels.sampling [--rows 8] [--vocab 49152] [--history 256] [--generated 32] [--runs 7] [--steps 50]

Each request has a `--history`-token prompt and `--generated` generated tokens (the penalty windows).
For each configuration, the median over --runs runs of the mean over --steps steps of:
- plan:   build_logits_plan (host; scatter indices, biases, masks),
- apply:  apply_logits_plan (the processors on a float32 copy of the rows that ask),
- step:   the whole Sampler call (plan + apply + greedy/draw + logprobs).
"Processors on" is every extra at once: repetition, presence and frequency penalties, 4 logit_bias
entries, min_tokens (binding) and min_p.
"""

import argparse
import statistics
import time

import torch

from core.messages import SamplingParams
from replicas.engine.batch_builder import sampling_rows
from replicas.request.request import Request
from replicas.sampling.processors import apply_logits_plan, build_logits_plan
from replicas.sampling.sampler import Sampler

EXTRAS = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
              logit_bias={11: 2.0, 42: -3.0, 1000: 5.0, 30000: -100.0}, min_tokens=64, min_p=0.05)
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=40)
CONFIGS = {
    "greedy, off": dict(temperature=0.0),
    "greedy, processors on": dict(temperature=0.0, **EXTRAS),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
    "temperature only, off": dict(temperature=0.8),
    "temperature only, on": dict(temperature=0.8, **EXTRAS),
    "sampled, off": dict(SAMPLED),
    "sampled, processors on": dict(SAMPLED, **EXTRAS),
    "sampled, on + logprobs 5": dict(SAMPLED, **EXTRAS, logprobs=5),
}


def make_requests(args, params: dict) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(args.rows):
        ids = torch.randint(0, args.vocab, (args.history + args.generated,), generator=g).tolist()
        req = Request(f"r{i}", ids[:args.history], SamplingParams(seed=i, **params), 1 << 20, frozenset({2}))
        req.token_ids += ids[args.history:]
        requests.append(req)
    return requests


def mean_ms(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps * 1e3


def measure(args, params: dict) -> tuple[float, float, float]:
    requests = make_requests(args, params)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)) * 3  # [R, vocab]
    sampler = Sampler()
    plan = build_logits_plan(sampling_rows(requests), args.vocab)
    runs = {"plan": [], "apply": [], "step": []}
    for _ in range(args.runs):
        runs["plan"].append(mean_ms(lambda: build_logits_plan(sampling_rows(requests), args.vocab), args.steps))
        runs["apply"].append(mean_ms(lambda: apply_logits_plan(logits, plan), args.steps))
        runs["step"].append(mean_ms(lambda: sampler(logits, sampling_rows(requests)), args.steps))
    return tuple(statistics.median(runs[k]) for k in ("plan", "apply", "step"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--history", type=int, default=256)
    parser.add_argument("--generated", type=int, default=32)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows x vocab {args.vocab}, {args.history}-token prompts + {args.generated} generated, "
          f"{args.threads} thread(s); ms per step, median of {args.runs} runs x {args.steps} steps")
    print(f"{'configuration':<28}{'plan':>8}{'apply':>8}{'step':>8}")
    for name, params in CONFIGS.items():
        plan_ms, apply_ms, step_ms = measure(args, params)
        print(f"{name:<28}{plan_ms:>8.3f}{apply_ms:>8.3f}{step_ms:>8.3f}")


if __name__ == "__main__":
    main()
