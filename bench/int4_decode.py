"""The int4 decode path on and off in one engine, interleaved: Engine.step() time at a few batch sizes.

    python bench/int4_decode.py [--streams 1 2 4 8] [--rounds 6] [--steps 10] [--max-rows 0 2 8]

One bf16 engine on the default SmolLM2 (a Q4_1 checkpoint: its linears are 4-bit groups, so they are
Int4Linear layers). For each batch size, --streams greedy streams decode while the rounds alternate
`INT4_MAX_ROWS` (0: the dense bf16 path for every batch; 2: the default; 8: the int4 path up to 8 rows),
--steps steps each; prints the median step time per setting. Same process, same weights, same moment:
the machine's drift cancels out of the comparison.
"""

import argparse
import statistics
import time

import torch

import replicas.kernels.cpu_linear.int4 as int4
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.messages import GenerateRequest, SamplingParams
from replicas.models.prepare import prepare_model

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-rows", type=int, nargs="+", default=[0, 2, 8])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(prepare_model("default", progress=False)), dtype="bfloat16"))
    num_int4 = sum(isinstance(m, int4.Int4Linear) for m in engine.model.modules())
    print(f"{num_int4} Int4Linear layers; {args.threads} threads; medians of {args.rounds} rounds x {args.steps} steps")
    prompt_ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=args.rounds * len(args.max_rows) * (args.steps + 1) + 16,
                            ignore_eos=True)
    print(f"{'streams':>8}" + "".join(f"{f'max rows {rows} (ms)':>20}" for rows in args.max_rows))
    for streams in args.streams:
        for i in range(streams):
            engine.add_request(GenerateRequest(f"s{streams}-{i}", prompt_ids, params))
        for _ in range(5):
            engine.step()  # prefill, warm-up
        times = {rows: [] for rows in args.max_rows}
        for _ in range(args.rounds):
            for rows in args.max_rows:
                int4.INT4_MAX_ROWS = rows
                engine.step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[rows].append((time.perf_counter() - start) / args.steps * 1e3)
        for request in list(engine.scheduler.running):
            engine.abort_request(request.request_id)
        while engine.has_unfinished():
            engine.step()
        print(f"{streams:>8}" + "".join(f"{statistics.median(times[rows]):>20.1f}" for rows in args.max_rows))


if __name__ == "__main__":
    main()
