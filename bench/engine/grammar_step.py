"""What a structured-output grammar costs a decode step: the real Engine on SmolLM2, a batch of streams.

    python -m bench.engine.grammar_step [--rows 8] [--steps 40] [--runs 3] [--threads 2]

For each configuration the batch is prefilled, then --steps decode steps are timed one by one (every row
decodes every step; ignore_eos, and a grammar that cannot end within them). Reported, median over --runs
(configurations alternated) of the mean per step, in ms:
- step:    Engine.step() whole (forward, grammar stage, sampler, postprocess, detokenize);
- mask:    GrammarManager.apply (fill each grammar row's bitmask with xgrammar, apply it to the logits);
- advance: GrammarState.advance for every grammar row (the matcher takes the sampled token).
Configurations: no grammar; 1 grammar row among plain ones; every row with a grammar. The grammar is a JSON
schema of a long array of small objects (a key, a short string, an enum): the matcher walks keys, strings and
enums over and over, as real JSON output does.
"""

import argparse
import json
import statistics
import time

import torch

from bench.common import chat_ids

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 10000, "items": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                     "kind": {"enum": ["noun", "verb", "adjective", "adverb"]},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "kind", "count"]}}}, "required": ["items"]}


class Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def run(engine, num_grammar_rows: int, args) -> tuple[float, float, float]:
    from core.messages import GenerateRequest, SamplingParams, StructuredSpec
    from replicas.sampling import grammar

    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    for i in range(args.rows):
        ids = chat_ids(engine.tokenizer, f"Write a list of {i + 3} English words with their part of speech, as JSON.")
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True,
                                structured=spec if i < num_grammar_rows else None)
        engine.add_request(GenerateRequest(f"r{i}", ids, params))
    while any(req.num_output_tokens == 0 for req in engine.requests.values()):
        engine.step()  # prefill
    mask = Timed(engine.grammars.apply)
    engine.grammars.apply = mask
    advance = Timed(grammar.GrammarState.advance)
    grammar.GrammarState.advance = lambda self, *a: advance(self, *a)
    try:
        start = time.perf_counter()
        for _ in range(args.steps):
            assert len(engine.step()) == args.rows
        elapsed = time.perf_counter() - start
    finally:
        del engine.grammars.apply
        grammar.GrammarState.advance = advance.fn
    while engine.has_unfinished():
        engine.step()
    return tuple(1000 * s / args.steps for s in (elapsed, mask.seconds, advance.seconds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from core.engine_config import EngineConfig
    from model_files.prepare import prepare_model
    from replicas.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(prepare_model("default", progress=False)), max_num_seqs=args.rows))
    print(f"SmolLM2, {engine.dtype}, {args.rows} rows, {args.threads} threads; ms per decode step")
    print("| grammar rows | step | mask | advance |\n|---|---|---|---|")
    configs = (0, 1, args.rows)
    results = {c: [] for c in configs}
    for _ in range(args.runs):  # alternated, so a noisy machine hurts every configuration alike
        for num_grammar_rows in configs:
            results[num_grammar_rows].append(run(engine, num_grammar_rows, args))
    for num_grammar_rows, runs in results.items():
        step, mask, advance = (statistics.median(r[k] for r in runs) for k in range(3))
        print(f"| {num_grammar_rows} of {args.rows} | {step:.2f} | {mask:.3f} | {advance:.3f} |")


if __name__ == "__main__":
    main()
