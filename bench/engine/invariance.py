"""Batch invariance: does a request's greedy output depend on what else its steps hold, and what does
engine.batch_invariant cost?

    python -m bench.engine.invariance [--dtype bfloat16 float32] [--batch-invariant 1 0] [--int4-decode 1 0]
                                      [--tokens 64] [--linears] [--cost ROUNDS]

For each dtype and mode (batch_invariant on; off with int4 decode on and off), in-process on SmolLM2 (prefix
caching off unless said):
- batch: six prompts, each alone, then the six among seven other requests of other lengths, all at
  once; how many of the six replies differ, and at which token each first does;
- chunked: one long prompt cold in one chunk, then cold in chunks of 64 tokens;
- cached: the same prompt again once the prefix cache holds it (all of it reused but the last token).
With --linears, first: for oneDNN's packed linear (replicas/kernels/cpu_linear) at SmolLM2's shapes in
bf16 and float32, the row counts at which row r's output is not bit-for-bit what it is alone, and the same
for the fixed-order kernel (invariant_gemm.cpp) that batch_invariant runs every linear on.
With --cost N, instead: per dtype, N alternating rounds of batch_invariant on and off (int4 decode on, the
default): decode ms per step at 1 and 8 streams and a cold 1,000-token prefill's ms to first token; medians.
"""

import argparse
import time

from testing.chat import chat_ids
from testing.invariance import OTHERS, PROMPTS

LONG = "The history of the lighthouse keepers of the northern coast is long. " * 12
SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # SmolLM2: gate/up, down, the head
ROW_COUNTS = [2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 128, 512, 1024]


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Every prompt at once; each one's generated ids, in prompt order."""
    from testing.invariance import greedy_replies

    return [[token for token, _ in reply] for reply in greedy_replies(engine, prompts, tokens)]


def run_mode(model_dir: str, dtype: str, batch_invariant: bool, int4_decode: bool, tokens: int) -> str:
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine

    def engine(**overrides):
        return Engine(EngineConfig(model=model_dir, dtype=dtype, int4_decode=int4_decode,
                                   batch_invariant=batch_invariant, **overrides))

    plain = engine(enable_prefix_caching=False, max_num_seqs=16)
    prompts = [chat_ids(plain.tokenizer, text) for text in PROMPTS]
    others = [chat_ids(plain.tokenizer, text) for text in OTHERS]
    alone = [greedy(plain, [prompt], tokens)[0] for prompt in prompts]
    mixed = greedy(plain, prompts + others, tokens)[:len(prompts)]
    firsts = [next((i for i, (x, y) in enumerate(zip(a, m)) if x != y), None) for a, m in zip(alone, mixed)]
    differ = [f for f in firsts if f is not None]
    long_ids = plain.tokenizer.encode(LONG)
    cold = greedy(plain, [long_ids], tokens)[0]
    chunked = greedy(engine(enable_prefix_caching=False, max_num_batched_tokens=64), [long_ids], tokens)[0]
    caching = engine(enable_prefix_caching=True)
    greedy(caching, [long_ids], 1)
    cached = greedy(caching, [long_ids], tokens)[0]
    batch = f"{len(differ)} of {len(prompts)} differ" + (f" (from token {', '.join(map(str, sorted(differ)))})"
                                                         if differ else "")
    mode = "batch_invariant" if batch_invariant else f"int4 decode {'on' if int4_decode else 'off'}"
    return (f"| {dtype}, {mode} | {batch} | "
            f"{'equal' if chunked == cold else 'differ'} | {'equal' if cached == cold else 'differ'} |")


def linear_rows() -> None:
    import torch

    from replicas.kernels.cpu_linear import PackedLinear, can_pack
    from replicas.kernels.cpu_linear.invariant_native import InvariantLinear, native_invariant

    kinds = [("oneDNN packed", PackedLinear, lambda dtype: can_pack(torch.device("cpu"), dtype)),
             ("fixed-order", InvariantLinear, lambda dtype: native_invariant() is not None)]
    for name, kind, available in kinds:
        for dtype in (torch.bfloat16, torch.float32):
            if not available(dtype):
                print(f"{name} {dtype}: not on this host")
                continue
            for k, n in SHAPES:
                torch.manual_seed(0)
                layer = kind(torch.nn.Linear(k, n, bias=False).to(dtype))
                x = torch.randn(max(ROW_COUNTS), k).to(dtype)
                alone = torch.cat([layer(x[r:r + 1]) for r in range(16)])  # rows 0..15, each alone
                bad = [m for m in ROW_COUNTS if not torch.equal(layer(x[:m])[:min(m, 16)], alone[:min(m, 16)])]
                print(f"{name} {str(dtype).removeprefix('torch.')} [{k} -> {n}]: rows differ from alone at "
                      f"M = {bad or 'none'}")


def step_costs(engine, prompt_ids: list[int], steps: int = 20) -> list[float]:
    """[1-stream decode ms / step, 8-stream decode ms / step, cold 1,000-token prefill ms to the first token]."""
    from core.messages import GenerateRequest, SamplingParams

    def decode_ms(streams: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(streams):
            engine.add_request(GenerateRequest(f"d{streams}-{i}-{time.perf_counter_ns()}", prompt_ids, params))
        for _ in range(3):  # the prefill and two decode steps
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
        while engine.has_unfinished():
            engine.step()
        return wall * 1e3

    vocab = engine.model_config.vocab_size
    cold = [(7 + 31 * (time.perf_counter_ns() + j)) % vocab for j in range(1000)]
    start = time.perf_counter()
    greedy(engine, [cold], 1)
    prefill_ms = (time.perf_counter() - start) * 1e3
    return [decode_ms(1), decode_ms(8), prefill_ms]


def cost(model_dir: str, dtype: str, rounds: int) -> None:
    from statistics import median

    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine

    engines = {on: Engine(EngineConfig(model=model_dir, dtype=dtype, enable_prefix_caching=False,
                                       max_num_batched_tokens=1024, batch_invariant=on)) for on in (True, False)}
    prompt_ids = engines[True].tokenizer.encode(PROMPTS[1])
    for engine in engines.values():
        step_costs(engine, prompt_ids, steps=3)  # warm-up
    results = {on: [] for on in engines}
    for _ in range(rounds):
        for on, engine in engines.items():
            results[on].append(step_costs(engine, prompt_ids))
    print(f"\n{dtype}, medians of {rounds} alternating rounds (ms):")
    print("| batch_invariant | 1-stream decode step | 8-stream decode step | cold 1,000-token prefill |\n|---|---|---|---|")
    for on, runs in results.items():
        print(f"| {'on' if on else 'off'} | " + " | ".join(f"{median(col):.1f}" for col in zip(*runs)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch-invariant", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    parser.add_argument("--int4-decode", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    parser.add_argument("--cost", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linears", action="store_true")
    args = parser.parse_args()
    import torch

    from bench.common import host_line
    from model_files.prepare import prepare_model

    torch.set_num_threads(args.threads)
    print(host_line())
    if args.linears:
        linear_rows()
    model_dir = str(prepare_model(args.model, progress=False))
    if args.cost:
        for dtype in args.dtype:
            cost(model_dir, dtype, args.cost)
        return
    print(f"\ngreedy {args.tokens} tokens; {len(PROMPTS)} prompts alone vs among {len(PROMPTS) + len(OTHERS)}")
    print("| dtype, mode | alone vs in a batch | chunked vs cold | cached vs cold |\n|---|---|---|---|")
    modes = [(True, True)] * (1 in args.batch_invariant) + \
        [(False, bool(int4)) for int4 in args.int4_decode] * (0 in args.batch_invariant)
    for dtype in args.dtype:
        for batch_invariant, int4_decode in modes:
            print(run_mode(model_dir, dtype, batch_invariant, int4_decode, args.tokens), flush=True)


if __name__ == "__main__":
    main()
