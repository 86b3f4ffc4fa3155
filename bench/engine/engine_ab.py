"""A/B of one engine knob in one engine, interleaved: the machine's drift cancels out of the comparison.

    python -m bench.engine.engine_ab int4 [--streams 1 2 4 8] [--values 0 2 8] [--rounds 6] [--steps 10]
    python -m bench.engine.engine_ab tile [--prompt-tokens 300 1000] [--values 1000000000 64 128] [--rounds 7]

One bf16 engine on the default SmolLM2; the rounds alternate the knob's values:
- int4: `INT4_MAX_ROWS` (replicas/kernels/cpu_linear/int4.py; 0: the dense bf16 path for every batch,
  2: the default). --streams greedy streams decode; per value, the median Engine.step() time of the
  rounds (--steps steps each). The Q4_1 checkpoint's linears are Int4Linear layers.
- tile: `PREFILL_TILE` (replicas/kernels/paged_attention/naive.py; 1000000000: one SDPA call per
  prefill group, 64: the default). Per value, the median time to the first token of a cold prompt of
  --prompt-tokens token ids (prefix caching off), first round not counted.
"""

import argparse
import statistics
import time

import torch

import replicas.kernels.cpu_linear.int4 as int4
import replicas.kernels.paged_attention.naive as paged_naive
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."
KNOBS = {"int4": (int4, "INT4_MAX_ROWS", [0, 2, 8]), "tile": (paged_naive, "PREFILL_TILE", [10 ** 9, 64, 128])}


def decode_rounds(engine: Engine, args, streams: int) -> dict[int, list[float]]:
    module, name, _ = KNOBS["int4"]
    params = SamplingParams(temperature=0.0, max_tokens=args.rounds * len(args.values) * (args.steps + 1) + 16,
                            ignore_eos=True)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    for i in range(streams):
        engine.add_request(GenerateRequest(f"s{streams}-{i}", prompt_ids, params))
    for _ in range(5):
        engine.step()  # prefill, warm-up
    times = {value: [] for value in args.values}
    for _ in range(args.rounds):
        for value in args.values:
            setattr(module, name, value)
            engine.step()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[value].append((time.perf_counter() - start) / args.steps * 1e3)
    for request in list(engine.scheduler.running):
        engine.abort_request(request.request_id)
    while engine.has_unfinished():
        engine.step()
    return times


def prefill_rounds(engine: Engine, args, num_tokens: int) -> dict[int, list[float]]:
    module, name, _ = KNOBS["tile"]
    vocab = engine.model_config.vocab_size
    times = {value: [] for value in args.values}
    for rnd in range(args.rounds + 1):
        for k, value in enumerate(args.values):
            setattr(module, name, value)
            seed = (rnd * len(args.values) + k) * num_tokens
            ids = [(7 + 31 * (seed + j)) % (vocab - 200) + 100 for j in range(num_tokens)]
            start = time.perf_counter()
            engine.add_request(GenerateRequest(f"p{num_tokens}-{rnd}-{k}", ids, SamplingParams(max_tokens=1)))
            while engine.has_unfinished():
                engine.step()
            if rnd:  # the first round warms up
                times[value].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("knob", choices=sorted(KNOBS))
    parser.add_argument("--values", type=int, nargs="+")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    module, name, defaults = KNOBS[args.knob]
    args.values = args.values or defaults
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(prepare_model("default", progress=False)), dtype="bfloat16",
                                 enable_prefix_caching=args.knob != "tile"))
    num_int4 = sum(isinstance(m, int4.Int4Linear) for m in engine.model.modules())
    what = "streams" if args.knob == "int4" else "prompt"
    print(f"{name}; {num_int4} Int4Linear layers; {args.threads} threads; medians of {args.rounds} rounds")
    print(f"{what:>8}" + "".join(f"{f'{name}={value} (ms)':>30}" for value in args.values))
    for size in (args.streams if args.knob == "int4" else args.prompt_tokens):
        times = decode_rounds(engine, args, size) if args.knob == "int4" else prefill_rounds(engine, args, size)
        print(f"{size:>8}" + "".join(f"{statistics.median(times[value]):>30.1f}" for value in args.values))


if __name__ == "__main__":
    main()
