"""Decode throughput: Tether's engine vs transformers `generate`, same model, same dtype, same run.

    python -m bench.engine.throughput [--model default] [--dtype auto] [--tokens 128] [--runs 3]

Measures, medians of --runs alternating runs:
- 1 stream: tokens/s of one greedy request of --tokens tokens;
- 8 streams: aggregate tokens/s of 8 concurrent requests (different prompts) of --tokens each;
- the resident memory (RSS) of the process holding one engine, before the peer is loaded.
Tokens/s = generated tokens / wall time from submission to the last token (prefill included;
the prompts are short chat turns).
"""

import argparse
import os
import statistics
import time

import psutil
import torch

from bench.common import QUESTIONS, chat_ids
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine


def run_tether(engine: Engine, prompts: list[list[int]], num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"b{i}-{start}", ids, params))
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(d.token_ids) for d in engine.step())
    assert generated == num_tokens * len(prompts)
    return generated / (time.perf_counter() - start)


@torch.inference_mode()
def run_transformers(model, tokenizer, prompts: list[list[int]], num_tokens: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == num_tokens
    return num_tokens * len(prompts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(prepare_model(args.model, progress=False))
    engine = Engine(EngineConfig(model=model_dir, dtype=args.dtype))
    rss_engine_mib = psutil.Process().memory_info().rss / 2**20
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS]

    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.dtype).eval()
    results = {name: [] for name in ("tether_1", "tether_8", "hf_1", "hf_8")}
    run_tether(engine, prompts[:1], 8)  # warm-up both
    run_transformers(peer, engine.tokenizer, prompts[:1], 8)
    for _ in range(args.runs):
        results["tether_1"].append(run_tether(engine, prompts[:1], args.tokens))
        results["hf_1"].append(run_transformers(peer, engine.tokenizer, prompts[:1], args.tokens))
        results["tether_8"].append(run_tether(engine, prompts, args.tokens))
        results["hf_8"].append(run_transformers(peer, engine.tokenizer, prompts, args.tokens))
    med = {name: statistics.median(values) for name, values in results.items()}

    print(f"model {model_dir}\ndtype {str(engine.dtype).removeprefix('torch.')}, {args.threads} threads, "
          f"{args.tokens} tokens per stream, medians of {args.runs} runs")
    print(f"{'':24}{'tether':>10}{'transformers':>14}{'ratio':>8}")
    for label, t, h in (("1 stream tok/s", "tether_1", "hf_1"), ("8 streams tok/s (sum)", "tether_8", "hf_8")):
        print(f"{label:24}{med[t]:>10.1f}{med[h]:>14.1f}{med[t] / med[h]:>8.2f}")
    print(f"tether 8 streams / 1 stream: {med['tether_8'] / med['tether_1']:.2f}x")
    print(f"RSS with one engine loaded: {rss_engine_mib:.0f} MiB "
          f"(KV pool {engine.block_pool.num_blocks} blocks of {engine.config.block_size} tokens)")


if __name__ == "__main__":
    main()
