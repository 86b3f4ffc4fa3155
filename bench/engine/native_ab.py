"""Native CPU ops on vs off, one model, two engines, alternating rounds (the machine's drift cancels out).

    python -m bench.engine.native_ab [--hybrid [SHAPE]] [--dtype auto] [--rounds 3] [--tokens 64] [--prompt-tokens 1000]

Engines: `engine.native_kernels` true (the native attention, int4 / int8 linears, fused ops) and false
(PyTorch ops; packed oneDNN linears in both). Per round and engine: one greedy stream's decode tok/s (Engine.step
after its prefill), 8 concurrent streams' aggregate tok/s (submission to last token, prefill included), and the
time to the first token of a cold --prompt-tokens prompt. --hybrid: bench/serve_path/multiturn.py's random-weight
Qwen3.5-text hybrid of SmolLM2's width (3 GatedDeltaNet layers per gated-attention layer) instead of SmolLM2;
--hybrid qwen3_5-0.8b (or another shape of bench/models/shaped_hybrid.py): a random-weight checkpoint of that
published shape. Off, a hybrid's recurrent layers run GatedDeltaNet's PyTorch path (naive.py's conv and chunked
/ recurrent delta rule); on, the two native ops of replicas/kernels/gated_delta_rule/cpu_native.py.
--recurrent-only: "off" keeps every other native op and turns off only the recurrent layers' (what the hybrid
kernels alone buy). Both engines run eager steps (the PyTorch recurrent path cannot be compiled). Prints medians
and the ratio, with the CPU's ISA level first.
"""

import argparse
import statistics
import time

import torch

from bench.common import host_line
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine
from replicas.models.gated_deltanet import GatedDeltaNet


def run(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Tokens per second of these prompts decoded together, submission to the last token."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(GenerateRequest(f"r{time.perf_counter_ns()}", prompt, params))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * tokens / (time.perf_counter() - start)


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> float:
    engine.add_request(GenerateRequest(f"d{time.perf_counter_ns()}", prompt,
                                       SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    engine.step()  # prefill and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (tokens - 1) / (time.perf_counter() - start)


def ttft(engine: Engine, num_tokens: int, salt: int) -> float:
    prompt = [(7919 * (i + 1) + 104729 * salt) % 40000 + 100 for i in range(num_tokens)]  # new each time
    engine.add_request(GenerateRequest(f"t{salt}", prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hybrid", nargs="?", const="random-576", default=None)
    parser.add_argument("--recurrent-only", action="store_true",
                        help="off = only the recurrent layers on PyTorch (the rest native in both); eager steps")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = str(prepare_model("default", progress=False))
    if args.hybrid == "random-576":
        from bench.serve_path.multiturn import random_hybrid

        model = random_hybrid("default")
    elif args.hybrid:
        from bench.models.shaped_hybrid import checkpoint

        model = str(checkpoint(args.hybrid))
    # eager steps in both: the PyTorch recurrent path cannot be compiled
    engines = {native: Engine(EngineConfig(model=model, dtype=args.dtype, compile_step=False,
                                           native_kernels=native or args.recurrent_only, enable_prefix_caching=False))
               for native in (True, False)}
    if args.recurrent_only:  # "off": every native op but the recurrent layers' (GatedDeltaNet's PyTorch path)
        for module in engines[False].model.modules():
            if isinstance(module, GatedDeltaNet):
                module.native = None
    prompts = [[(31 * i + 17 * j) % 30000 + 200 for j in range(40 + i)] for i in range(8)]
    results = {native: {"1 stream tok/s": [], "8 streams tok/s": [], "TTFT ms": []} for native in engines}
    for r in range(args.rounds + 1):  # round 0 warms up
        for native, engine in engines.items():
            row = (decode_rate(engine, prompts[0], args.tokens), run(engine, prompts, args.tokens),
                   1000 * ttft(engine, args.prompt_tokens, r))
            if r:
                for key, value in zip(results[native], row):
                    results[native][key].append(value)
    print(host_line())
    name = {None: "SmolLM2-135M", "random-576": "hybrid (random Qwen3.5-text, 576 wide)"}.get(args.hybrid)
    off = "the recurrent layers only" if args.recurrent_only else "every native op"
    print(f"{name or f'random-weight {args.hybrid}'}, off = {off}, eager steps, {engines[True].dtype}, 2 threads, "
          f"medians of {args.rounds} rounds")
    for key in results[True]:
        on, off = (statistics.median(results[n][key]) for n in (True, False))
        print(f"{key:16s} native {on:8.1f}  pytorch {off:8.1f}  ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
