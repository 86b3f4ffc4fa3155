"""MoE decode throughput against a dense model of the same active parameter count, same engine, same run.

    python -m bench.engine.moe_throughput [--dtype auto] [--tokens 64] [--runs 3] [--experts 8] [--top-k 2]

Two random-weight Qwen3 checkpoints with SmolLM2's tokenizer, identical but for the MLP:
- MoE (Qwen3MoeForCausalLM): --experts experts of --expert-size, top --top-k, on every layer;
- dense (Qwen3ForCausalLM): one SwiGLU of top_k * expert_size, so each token runs the same MLP parameters.
Reports 1- and 8-stream tok/s of each (bench/engine/throughput.py's measure: greedy, ignore_eos, short chat
prompts, prefill included), medians of --runs alternating runs, the ratios, and the host's CPU flags. Issue
13's targets: MoE >= 0.7x dense at 1 stream, >= 0.5x at 8 streams.
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import QUESTIONS, chat_ids, host_line
from bench.engine.throughput import run_tether
from core.engine_config import EngineConfig
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine


def build(kind: str, out: Path, tokenizer_dir: Path, args) -> Path:
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    common = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                  max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k,
                                             moe_intermediate_size=args.expert_size, norm_topk_prob=True,
                                             intermediate_size=args.top_k * args.expert_size, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(intermediate_size=args.top_k * args.expert_size, **common)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer_dir = prepare_model("default", progress=False)
    root = Path(tempfile.mkdtemp(prefix="tether-moe-bench-"))
    engines = {kind: Engine(EngineConfig(model=str(build(kind, root / kind, tokenizer_dir, args)), dtype=args.dtype))
               for kind in ("moe", "dense")}
    params = {kind: sum(p.numel() for p in e.model.parameters()) for kind, e in engines.items()}
    prompts = [chat_ids(engines["moe"].tokenizer, q) for q in QUESTIONS]
    results = {f"{kind}_{n}": [] for kind in engines for n in (1, 8)}
    for engine in engines.values():
        run_tether(engine, prompts[:1], 8)  # warm-up
    for _ in range(args.runs):
        for kind, engine in engines.items():
            results[f"{kind}_1"].append(run_tether(engine, prompts[:1], args.tokens))
            results[f"{kind}_8"].append(run_tether(engine, prompts, args.tokens))
    med = {name: statistics.median(values) for name, values in results.items()}
    print(host_line())
    print(f"dtype {str(engines['moe'].dtype).removeprefix('torch.')}, {args.threads} threads, hidden {args.hidden}, "
          f"{args.layers} layers, {args.experts} experts x {args.expert_size} top-{args.top_k} vs dense "
          f"{args.top_k * args.expert_size}; {args.tokens} tokens per stream, medians of {args.runs} runs")
    print(f"parameters: moe {params['moe'] / 1e6:.1f} M, dense {params['dense'] / 1e6:.1f} M "
          f"(the same active per token)")
    print(f"{'':24}{'moe':>10}{'dense':>10}{'ratio':>8}{'target':>8}")
    for n, target in ((1, 0.7), (8, 0.5)):
        ratio = med[f"moe_{n}"] / med[f"dense_{n}"]
        print(f"{f'{n} stream(s) tok/s':24}{med[f'moe_{n}']:>10.1f}{med[f'dense_{n}']:>10.1f}{ratio:>8.2f}"
              f"{'>= ' + str(target):>8}")


if __name__ == "__main__":
    main()
