"""Routing: how much prompt each router serves from cache on a multi-turn workload, in one run.

    python -m bench.serve_path.routing [--replicas 2] [--conversations 16] [--turns 6] [--reps 2] [--model default]

One local Ray instance; for each router in turn a fresh Serve app (the production
builder, `--replicas` ModelReplicas, 1 thread each) and the same workload:
`--conversations` concurrent conversations x `--turns` turns, all with one shared
system prompt (~150 tokens), user turns of ~50 tokens, greedy replies of
`--reply-tokens`, and a user's think time before each turn (`--think-s`, seeded:
the same for every router). Without think time, a closed loop of conversations makes
a least-loaded router sticky by accident: the replica that just finished a turn is
the less loaded one when the next turn of the same conversation arrives.
"Turns moved" reports how often a turn landed on another replica than its previous
turn. Routers:
- tether: cache_router.ConversationRouter (the default of build_app / build_app_with);
- pow2: Ray Serve's default PowerOfTwoChoicesRequestRouter;
- prefix-aware: Ray Serve LLM's PrefixCacheAffinityRouter (its char-level prefix
  tree over the prompt; given token ids, one character per id, since the replica
  call carries ids, not text); skipped if it cannot be imported;
- single: one replica with the Tether router: the ceiling for the cache-served share.
Per router: the share of prompt tokens served from cache (usage), the prompt
tokens the replicas computed (their own counters, recomputation included), and
median / p90 time to first token (first SSE content event). --reps repeats the
whole comparison; medians are reported.
"""

import argparse
import asyncio
import inspect
import json
import logging
import os
import random
import statistics
import time

import openai

from bench.common import ROOT, local_ray_defaults, percentile, write_json

SYSTEM = ("You are a meticulous travel assistant for a small guidebook publisher. Answer in plain, friendly "
          "English. Keep every answer short: two or three sentences at most, no lists, no headings. When a "
          "question is vague, pick the most common reading and answer that. Mention one practical tip when it "
          "helps a first-time visitor. Never invent opening hours, prices or phone numbers; say that they "
          "change and should be checked locally. Prefer public transport, walking and cycling in your tips. "
          "If asked about safety, be calm and factual. If asked for comparisons, name one clear difference. "
          "Use metric units, and the 24-hour clock for times.")
PLACES = ["Lisbon", "Kyoto", "Oaxaca", "Tallinn", "Hobart", "Marrakesh", "Bergen", "Cusco",
          "Ljubljana", "Hanoi", "Valparaiso", "Tbilisi", "Quebec", "Galway", "Matera", "Luang Prabang"]
ASPECTS = ["the old town", "local food", "day trips", "getting around", "the best season", "museums"]


def user_turn(conversation: int, turn: int) -> str:
    place = PLACES[conversation % len(PLACES)]
    aspect = ASPECTS[turn % len(ASPECTS)]
    return (f"Trip {conversation}, question {turn + 1}: I will spend four days in {place} next spring with a "
            f"friend who walks slowly. What should we know about {aspect} there, and what is one thing most "
            f"visitors get wrong about it?")


async def conversation(client, model: str, index: int, turns: int, reply_tokens: int,
                       think_s: float) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    records = []
    pause = random.Random(index)  # the same think times for every router
    for turn in range(turns):
        await asyncio.sleep(pause.uniform(0.5, 1.5) * think_s)
        messages.append({"role": "user", "content": user_turn(index, turn)})
        start = time.perf_counter()
        ttft, text, usage = None, "", None
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=reply_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        replica = raw.headers.get("x-tether-replica")
        stream = raw.parse()  # an AsyncStream (awaitable in some openai versions)
        stream = await stream if inspect.isawaitable(stream) else stream
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        records.append({"prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
                        "ttft": ttft, "replica": replica,
                        "moved": turn > 0 and replica != records[-1]["replica"]})
        messages.append({"role": "assistant", "content": text})
    return records


def engine_totals(handle, num_replicas: int) -> dict:
    """Summed engine counters of every replica (keyless calls: asked until each answered)."""
    seen = {}
    for _ in range(50 * num_replicas):
        stats = handle.engine_stats.remote().result()
        seen[stats["replica_id"]] = stats
        if len(seen) == num_replicas:
            break
    assert len(seen) == num_replicas, f"only {len(seen)} of {num_replicas} replicas answered"
    return {k: sum(s[k] for s in seen.values()) for k in ("num_prompt_tokens_computed", "num_prompt_tokens_cached")}


def routers() -> dict:
    from ray.serve.config import RequestRouterConfig

    table = {"tether": None, "pow2": RequestRouterConfig()}
    try:
        from bench.serve_path.ray_routers import TokenPrefixCacheAffinityRouter

        table["prefix-aware"] = RequestRouterConfig(request_router_class=TokenPrefixCacheAffinityRouter)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        print(f"prefix-aware: skipped ({err!r})")
    return table


def run_one(name: str, router, num_replicas: int, args) -> dict:
    from ray import serve

    from serve_app.app import build_app_with

    app = build_app_with({"model": args.model, "served_model_name": "bench", "num_replicas": num_replicas,
                            "replica_num_cpus": 0, "dtype": args.dtype,
                            "engine": {"num_threads": max(1, args.threads // num_replicas)}}, router)
    serve.run(app, name="bench", route_prefix="/")
    handle = serve.get_deployment_handle("ModelReplica", app_name="bench")
    before = engine_totals(handle, num_replicas)

    async def everything():
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(conversation(client, "bench", i, args.turns, args.reply_tokens,
                                                       args.think_s) for i in range(args.conversations)))

    start = time.perf_counter()
    records = [r for conv in asyncio.run(everything()) for r in conv]
    wall = time.perf_counter() - start
    after = engine_totals(handle, num_replicas)
    serve.delete("bench")
    prompt = sum(r["prompt"] for r in records)
    ttfts = [r["ttft"] for r in records]
    per_replica = sorted(sum(1 for r in records if r["replica"] == rid) for rid in {r["replica"] for r in records})
    return {"router": name, "replicas": num_replicas, "prompt_tokens": prompt,
            "turns_moved": sum(r["moved"] for r in records) / (len(records) - args.conversations),
            "requests_per_replica": per_replica,
            "cached_share": sum(r["cached"] for r in records) / prompt,
            "computed": after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
            "ttft_p50": statistics.median(ttfts), "ttft_p90": percentile(ttfts, 0.9), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--think-s", type=float, default=1.0,
                        help="mean pause before each turn (uniform 0.5x..1.5x, seeded per conversation)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by replicas")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--json", help="also write every run's numbers here")
    parser.add_argument("--routers", type=lambda text: text.split(","),
                        default=["tether", "pow2", "prefix-aware", "single"],
                        help="comma-separated subset of tether,pow2,prefix-aware,single")
    args = parser.parse_args()
    local_ray_defaults()

    import ray
    from ray import serve

    # the repository root on the actors' path: Serve imports bench.serve_path.ray_routers there
    ray.init(num_cpus=max(2, args.threads), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    logging.getLogger("httpx").setLevel(logging.WARNING)  # after ray.init, which configures logging
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    table = {name: router for name, router in routers().items() if name in args.routers}
    results = []
    for rep in range(args.reps):
        for name, router in table.items():
            results.append({**run_one(name, router, args.replicas, args), "rep": rep})
            print(json.dumps(results[-1]), flush=True)
        if "single" in args.routers:
            results.append({**run_one("single", None, 1, args), "rep": rep})
            print(json.dumps(results[-1]), flush=True)
    serve.shutdown()
    ray.shutdown()
    report(results)
    if args.json:
        write_json(args.json, results)


def report(results: list[dict]) -> None:
    names = list(dict.fromkeys(r["router"] for r in results))
    med = {n: {k: statistics.median(r[k] for r in results if r["router"] == n)
               for k in ("cached_share", "computed", "turns_moved", "ttft_p50", "ttft_p90", "wall_s")} for n in names}
    print("\n| router | replicas | cache-served share | prompt tokens computed | turns moved | TTFT p50 (s) | "
          "TTFT p90 (s) | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        m = med[n]
        replicas = next(r["replicas"] for r in results if r["router"] == n)
        print(f"| {n} | {replicas} | {m['cached_share']:.3f} | {m['computed']:.0f} | {m['turns_moved']:.2f} | "
              f"{m['ttft_p50']:.3f} | "
              f"{m['ttft_p90']:.3f} | {m['wall_s']:.1f} |")
    if {"single", "pow2", "tether"} <= set(med):
        t = med["tether"]
        print(f"\ntether cache-served share / single replica: {t['cached_share'] / med['single']['cached_share']:.3f}"
              f" (target >= 0.95); tether computed / pow2 computed: {t['computed'] / med['pow2']['computed']:.3f}"
              f" (target <= 0.5)")


if __name__ == "__main__":
    main()
