"""Batch invariance: does a request's greedy output depend on what else its steps hold?

    python -m bench.engine.invariance [--dtype bfloat16 float32] [--int4-decode 1 0] [--tokens 64]
                                      [--linears]

For each dtype and int4-decode setting, in-process on SmolLM2 (prefix caching off unless said):
- batch: six prompts, each alone, then the six among seven other requests of other lengths, all at
  once; how many of the six replies differ, and at which token each first does;
- chunked: one long prompt cold in one chunk, then cold in chunks of 64 tokens;
- cached: the same prompt again once the prefix cache holds it (all of it reused but the last token).
With --linears, first: for oneDNN's packed linear (replicas/kernels/cpu_linear) at SmolLM2's shapes in
bf16 and float32, the row counts at which row r's output is not bit-for-bit what it is alone.
"""

import argparse
import time

PROMPTS = ["Tell me about the sea.", "Why is the sky blue? Explain it carefully to a child who asks.",
           "Write a poem about autumn.", "What is 17 times 23?",
           "List three uses of copper in modern electronics and industry.", "Describe Paris."]
OTHERS = ["Hi", "Explain photosynthesis in detail, step by step, with examples of plants and algae.",
          "Count to ten.", "What are the rules of chess? " * 3, "Name a color.",
          "Give me a recipe for bread with flour, water, salt.", "Ok"]
LONG = "The history of the lighthouse keepers of the northern coast is long. " * 12
SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # SmolLM2: gate/up, down, the head
ROW_COUNTS = [2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 128, 512, 1024]


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Every prompt at once; each one's generated ids, in prompt order."""
    from core.messages import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"r{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(GenerateRequest(request_id, prompt, params))
    out = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return [out[request_id] for request_id in ids]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_mode(model_dir: str, dtype: str, int4_decode: bool, tokens: int) -> str:
    from bench.common import chat_ids
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine

    def engine(**overrides):
        return Engine(EngineConfig(model=model_dir, dtype=dtype, int4_decode=int4_decode, **overrides))

    plain = engine(enable_prefix_caching=False, max_num_seqs=16)
    prompts = [chat_ids(plain.tokenizer, text) for text in PROMPTS]
    others = [chat_ids(plain.tokenizer, text) for text in OTHERS]
    alone = [greedy(plain, [prompt], tokens)[0] for prompt in prompts]
    mixed = greedy(plain, prompts + others, tokens)[:len(prompts)]
    firsts = [first_difference(a, m) for a, m in zip(alone, mixed)]
    differ = [f for f in firsts if f is not None]
    long_ids = plain.tokenizer.encode(LONG)
    cold = greedy(plain, [long_ids], tokens)[0]
    chunked = greedy(engine(enable_prefix_caching=False, max_num_batched_tokens=64), [long_ids], tokens)[0]
    caching = engine(enable_prefix_caching=True)
    greedy(caching, [long_ids], 1)
    cached = greedy(caching, [long_ids], tokens)[0]
    batch = f"{len(differ)} of {len(prompts)} differ" + (f" (from token {', '.join(map(str, sorted(differ)))})"
                                                         if differ else "")
    return (f"| {dtype}, int4 decode {'on' if int4_decode else 'off'} | {batch} | "
            f"{'equal' if chunked == cold else 'differ'} | {'equal' if cached == cold else 'differ'} |")


def linear_rows() -> None:
    import torch

    from replicas.kernels.cpu_linear import PackedLinear, can_pack

    for dtype in (torch.bfloat16, torch.float32):
        if not can_pack(torch.device("cpu"), dtype):
            print(f"{dtype}: no oneDNN packing on this host")
            continue
        for k, n in SHAPES:
            torch.manual_seed(0)
            packed = PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
            x = torch.randn(max(ROW_COUNTS), k).to(dtype)
            alone = torch.cat([packed(x[r:r + 1]) for r in range(16)])  # rows 0..15, each alone
            bad = [m for m in ROW_COUNTS if not torch.equal(packed(x[:m])[:min(m, 16)], alone[:min(m, 16)])]
            print(f"{str(dtype).removeprefix('torch.')} [{k} -> {n}]: rows differ from alone at M = {bad or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--int4-decode", type=int, nargs="+", choices=[0, 1], default=[1, 0])
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
    print(f"\ngreedy {args.tokens} tokens; {len(PROMPTS)} prompts alone vs among {len(PROMPTS) + len(OTHERS)}")
    print("| dtype, int4 decode | alone vs in a batch | chunked vs cold | cached vs cold |\n|---|---|---|---|")
    for dtype in args.dtype:
        for int4_decode in args.int4_decode:
            print(run_mode(model_dir, dtype, bool(int4_decode), args.tokens), flush=True)


if __name__ == "__main__":
    main()
