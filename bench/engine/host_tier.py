"""Host tier: the share of prompt tokens served from cache when the KV pool holds a quarter of the working set.

    python -m bench.engine.host_tier [--conversations 32] [--turns 4] [--reply-tokens 16] [--concurrency 4]

One in-process Engine per mode (SmolLM2-135M-Instruct, the dtype the host picks, 2 threads, no server),
the same workload each time: --conversations chats interleaved round-robin (turn k of every
conversation before turn k + 1 of any), ~60-token user turns, greedy replies of at most --reply-tokens,
--concurrency conversations at a time. A turn's prompt is the previous prompt + the reply's ids + the
next user turn's ids (what retention sends); the replies are mode (a)'s in every mode, so every mode
sends the same ids.

Modes: (a) an unbounded pool (its cached blocks at the end are the working set W); (b) a pool of W / 4
blocks, no tier; (c) the same pool + a host tier of --tiers times the pool's byte budget (1: the same
budget); (e) the 1x tier without packing (a raw copy); (f) a pool of W / 2, no tier: the RAM of (c) at 1x,
all of it pool (on CPU, what raising kv_cache_bytes instead buys). Per mode: the share of prompt tokens served from
cache (engine counters: cached / (cached + computed)); the tier's packing ratio, its packing and restore
costs per token (restore: unpack + write back into the pool) and its seconds on the step thread in all;
`differ`: replies unlike mode (a)'s. The tier is lossless, and with engine.batch_invariant (the default) a
token's numerics do not depend on what else its step holds, so every mode's replies equal (a)'s. With
--no-batch-invariant a reply can differ in bfloat16 because they do (4-bit decode at <= 2 rows, dense bf16
otherwise: mode (b), without a tier, differs too; --no-int4-decode to compare).
"""

import argparse
import statistics
import time

import torch

from bench.common import chat_ids, host_line, user_turn
from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from model_files.prepare import prepare_model
from replicas.engine.engine import Engine


class Workload:
    """The conversations' ids, turn by turn: the next prompt extends the last prompt + its reply exactly."""

    def __init__(self, tokenizer, num_conversations: int):
        self.tokenizer = tokenizer
        self.prompts = [chat_ids(tokenizer, user_turn(c, 0)) for c in range(num_conversations)]
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def extend(self, conv: int, turn: int, reply: list[int]) -> None:
        end = "\n" if reply and reply[-1] == self.eos else "<|im_end|>\n"
        text = f"{end}<|im_start|>user\n{user_turn(conv, turn)}<|im_end|>\n<|im_start|>assistant\n"
        self.prompts[conv] = self.prompts[conv] + reply + self.tokenizer.encode(text, add_special_tokens=False)


def run_mode(model: str, args, script: dict | None = None, **engine) -> dict:
    """Runs the whole workload on a fresh engine; the next turns' prompts take the replies in `script` (the
    unbounded pool's) when given, so every mode sends the same ids. -> counters, replies, tier stats, wall time."""
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.concurrency,
                              int4_decode=not args.no_int4_decode, batch_invariant=not args.no_batch_invariant,
                              **engine))
    work = Workload(eng.tokenizer, args.conversations)
    replies, last_prompt_len = {}, 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for first in range(0, args.conversations, args.concurrency):
            convs = range(first, min(first + args.concurrency, args.conversations))
            for c in convs:
                last_prompt_len = max(last_prompt_len, len(work.prompts[c]))
                eng.add_request(GenerateRequest(f"c{c}-t{turn}", list(work.prompts[c]),
                                                SamplingParams(temperature=0.0, max_tokens=args.reply_tokens)))
            outs = {f"c{c}-t{turn}": [] for c in convs}
            while eng.has_unfinished():
                for delta in eng.step():
                    outs[delta.request_id] += delta.token_ids
            for c in convs:
                replies[(c, turn)] = outs[f"c{c}-t{turn}"]
                work.extend(c, turn + 1, (script or replies)[(c, turn)])
    wall = time.perf_counter() - start
    tier = eng.host_tier
    return {"cached": eng.stats.num_prompt_tokens_cached, "computed": eng.stats.num_prompt_tokens_computed,
            "replies": replies, "wall": wall, "last_prompt_len": last_prompt_len,
            "num_cached_blocks": len(eng.block_pool.cached),
            "bytes_per_block": eng.memory["num_kv_cache_bytes"] // eng.block_pool.num_blocks,
            "preemptions": eng.scheduler.num_preemptions, "tier": vars(tier.stats) if tier else None,
            "tier_bytes": tier.num_bytes if tier else 0, "block_size": eng.config.block_size,
            "dtype": str(eng.dtype).removeprefix("torch.")}


def prefill_ms_per_token(model: str, args, num_tokens: int, reps: int = 3) -> float:
    """Cold prefill of a `num_tokens` prompt (the workload's last-turn length), median ms per token."""
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, enable_prefix_caching=False,
                              batch_invariant=not args.no_batch_invariant))
    times = []
    for rep in range(reps + 1):  # the first warms up
        ids = [(7919 * (rep * num_tokens + i)) % 40000 + 100 for i in range(num_tokens)]
        eng.add_request(GenerateRequest(f"p{rep}", ids, SamplingParams(temperature=0.0, max_tokens=1)))
        start = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        times.append((time.perf_counter() - start) * 1000 / num_tokens)
    return statistics.median(times[1:])


def report(results: dict, baseline: dict, prefill_ms: float) -> None:
    base_share = baseline["cached"] / (baseline["cached"] + baseline["computed"])
    print(f"\n{'mode':<34} {'cached share':>12} {'vs (a), pp':>10} {'computed':>9} {'wall s':>7} {'tier s':>6} "
          f"{'ratio':>6} {'pack us/tok':>11} {'restore us/tok':>14} {'restored':>8} {'dropped':>8} {'differ':>6}")
    for name, r in results.items():
        share = r["cached"] / (r["cached"] + r["computed"])
        num_differ = sum(r["replies"][k] != v for k, v in baseline["replies"].items())
        cols = ["", "", "", "", "", ""]
        if r["tier"]:
            t, bs = r["tier"], r["block_size"]
            ratio = t["num_raw_bytes_stored"] / max(1, t["num_packed_bytes_stored"])
            pack_us = t["pack_seconds"] * 1e6 / max(1, t["num_blocks_stored"] * bs)
            restore_us = t["restore_seconds"] * 1e6 / max(1, t["num_blocks_restored"] * bs)
            cols = [f"{ratio:.3f}", f"{pack_us:.1f}", f"{restore_us:.1f}", t["num_blocks_restored"],
                    t["num_blocks_dropped"], f"{t['pack_seconds'] + t['restore_seconds']:.1f}"]
        print(f"{name:<34} {share:>12.3f} {(share - base_share) * 100:>+10.1f} {r['computed']:>9} "
              f"{r['wall']:>7.1f} {cols[5]:>6} {cols[0]:>6} {cols[1]:>11} {cols[2]:>14} {cols[3]:>8} {cols[4]:>8} "
              f"{num_differ:>6}")
    preempted = {name: r["preemptions"] for name, r in results.items() if r["preemptions"]}
    print(f"preemptions (their recomputation counts in `computed`): {preempted or 'none'}")
    print(f"prefill (recomputation), cold, at the last turn's length: {prefill_ms * 1000:.0f} us/token; "
          f"differ: replies (of {len(baseline['replies'])}) unlike the unbounded pool's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tiers", default="1,2,3", help="tier budgets, in pool budgets")
    parser.add_argument("--no-int4-decode", action="store_true", help="engine.int4_decode off (dense bf16 steps)")
    parser.add_argument("--no-batch-invariant", action="store_true", help="engine.batch_invariant off")
    parser.add_argument("--no-raw-copy", action="store_true", help="skip mode (e)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = str(prepare_model(args.model, progress=False))
    print(f"{host_line()}; torch threads 2")
    results = {"(a) unbounded pool": run_mode(model, args, num_kv_blocks=8192)}
    base = results["(a) unbounded pool"]
    working_set = base["num_cached_blocks"]
    pool = working_set // 4
    pool_bytes = pool * base["bytes_per_block"]
    print(f"model {model}, {base['dtype']}; {args.conversations} conversations x {args.turns} turns, replies <= "
          f"{args.reply_tokens} tokens, {args.concurrency} at a time; working set W = {working_set} blocks of "
          f"{base['block_size']} tokens ({base['bytes_per_block']} bytes each); pool W / 4 = {pool} blocks "
          f"({pool_bytes / 2**20:.1f} MiB)")
    script = base["replies"]
    results["(b) pool W/4, no tier"] = run_mode(model, args, script, num_kv_blocks=pool)
    for x in (float(v) for v in args.tiers.split(",")):
        results[f"(c) pool W/4 + tier {x:g}x, zlib"] = run_mode(model, args, script, num_kv_blocks=pool,
                                                               host_tier_bytes=int(x * pool_bytes))
    # The same RAM as (c) at 1x, all of it pool: what a CPU replica gets from raising kv_cache_bytes instead.
    results["(f) pool W/2, no tier"] = run_mode(model, args, script, num_kv_blocks=2 * pool)
    if not args.no_raw_copy:
        results["(e) pool W/4 + tier 1x, raw copy"] = run_mode(model, args, script, num_kv_blocks=pool,
                                                               host_tier_bytes=pool_bytes, host_tier_codec="none")
    report(results, base, prefill_ms_per_token(model, args, base["last_prompt_len"]))


if __name__ == "__main__":
    main()
