"""Soak: many concurrent streaming clients against a local Serve app for N minutes, with figures.

    python -m bench.reliability.soak [--minutes 10] [--clients 64] [--replicas 2] [--kv-mib 64]
                                     [--retained-tokens 65536] [--plot docs/reliability_soak.png]

127.0.0.1 only, bounded in time. One Serve app (build_app: the ingress + --replicas ModelReplicas of the
default model, one CPU each, caches capped small so they fill in the first minutes) and --clients asyncio
clients, each looping until the deadline over a mix:
- chat conversations of up to 6 turns (the client sends the assistant replies back) and completions;
- n from 1 to 4, max_tokens from 8 to 64, a stop string on a quarter of them;
- a tenth disconnect after a few chunks; a tenth read slowly (0.2 s between chunks);
- a 429 / 503 is waited out for its Retry-After, as the openai SDK does.
Each replica's queue holds clients x 4 / replicas requests (every client's n choices at once).
Every 5 s each replica's engine counters are sampled through the replica handle (resident memory, KV blocks
in use, retained tokens, checkpoint bytes, running / waiting sequences).

At the end: requests by status, TTFT and inter-chunk latency p50 / p99 per minute, and the checks:
0 unexpected 5xx (503 / 429 backpressure is counted apart, target <= 5%), 0 hung streams (a stream with no
chunk for 60 s), every replica idle with no KV block in use, and each replica's resident memory after
warm-up (once every cache has reached its cap) within +-10% of its median after warm-up. Prints the CPU
flags first; plots the curves to --plot.
"""

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.common import ROOT, TOPICS, host_line, local_ray_defaults, percentile

HUNG_S = 60.0  # a stream with no chunk for this long is hung
STOPS = ["\n\n", ".", " the", "!"]


@dataclass
class Record:
    start: float
    route: str
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    disconnected: bool = False
    hung: bool = False
    error: str = ""


async def one_request(client: httpx.AsyncClient, route: str, body: dict, rng: random.Random, records: list,
                      t0: float) -> str:
    """Streams one request; -> the text of choice 0 (for the conversation). Appends its Record."""
    record = Record(time.perf_counter() - t0, route)
    records.append(record)
    disconnect_after = rng.randint(1, 4) if rng.random() < 0.1 else None
    slow = rng.random() < 0.1
    text, last, num_chunks = "", time.perf_counter(), 0
    try:
        async with client.stream("POST", route, json={**body, "stream": True}) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:200]
                if response.status_code in (429, 503):  # backpressure: wait as told, as the openai SDK does
                    await asyncio.sleep(float(response.headers.get("retry-after", 1)))
                return ""
            lines = response.aiter_lines()
            while True:
                try:
                    line = await asyncio.wait_for(lines.__anext__(), HUNG_S)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    record.hung = True
                    break
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - t0 - record.start
                else:
                    record.gaps.append(now - last)
                last, num_chunks = now, num_chunks + 1
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices", []):
                    if choice.get("index", 0) == 0:
                        text += choice.get("delta", {}).get("content") or choice.get("text") or ""
                if disconnect_after is not None and num_chunks >= disconnect_after:
                    record.disconnected = True
                    break
                if slow:
                    await asyncio.sleep(0.2)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return text


async def client_loop(k: int, deadline: float, records: list, t0: float, port: int) -> None:
    rng = random.Random(k)
    messages: list[dict] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(120.0)) as client:
        while time.perf_counter() < deadline:
            common = {"model": "soak", "n": rng.randint(1, 4), "max_tokens": rng.randint(8, 64),
                      "temperature": rng.choice([0.0, 0.8])}
            if rng.random() < 0.25:
                common["stop"] = [rng.choice(STOPS)]
            if rng.random() < 0.3:
                prompt = f"Client {k}: a short note about {rng.choice(TOPICS)}:"
                await one_request(client, "/v1/completions", {**common, "prompt": prompt}, rng, records, t0)
                continue
            if len(messages) >= 11:  # 6 user turns: a new conversation
                messages = []
            messages.append({"role": "user", "content": f"Client {k}, turn {len(messages) // 2 + 1}: tell me "
                                                        f"about {rng.choice(TOPICS)} in a few words."})
            reply = await one_request(client, "/v1/chat/completions", {**common, "messages": messages}, rng,
                                      records, t0)
            messages.append({"role": "assistant", "content": reply or "..."})


def replica_stats(handle, num_replicas: int) -> dict[str, dict]:
    """replica id -> engine_stats, asking keyless until every replica answered (or 40 tries)."""
    seen = {}
    for _ in range(40 * num_replicas):
        stats = handle.engine_stats.remote().result(timeout_s=30)
        stats.setdefault("num_blocks_used", stats["num_blocks"] - stats["num_free_blocks"])  # cached-free is free
        seen[stats["replica_id"]] = stats
        if len(seen) == num_replicas:
            break
    return seen


async def sampler(handle, num_replicas: int, deadline: float, samples: list, t0: float) -> None:
    while time.perf_counter() < deadline:
        stats = await asyncio.to_thread(replica_stats, handle, num_replicas)
        samples.append((time.perf_counter() - t0, stats))
        await asyncio.sleep(5.0)


def start_app(args):
    from ray import serve

    from model_files.prepare import prepare_model
    from serve_app.local_ray import start_local_app

    model_dir = str(prepare_model("default", progress=False))
    # Queues deep enough for every client's n choices (64 x up to 4 over 2 replicas of 16 running each):
    # past them Serve answers 503 (backpressure, counted apart). The fast path: the Ingress answers HTTP.
    spec = {"model": model_dir, "served_model_name": "soak", "num_replicas": args.replicas, "replica_num_cpus": 1,
            "replica_max_queued_requests": args.clients * 4 // args.replicas,
            "engine": {"num_threads": 1, "kv_cache_bytes": args.kv_mib << 20,
                       "max_retained_tokens": args.retained_tokens, "max_num_seqs": 16}}
    start_local_app(spec, args.port, num_cpus=max(2, args.replicas))
    return serve.get_deployment_handle("ModelReplica", app_name="tether")


def warmed_up_at(samples: list, args) -> float | None:
    """When every replica's retained tokens first reached 90% of the cap (the KV pool fills first)."""
    for t, stats in samples:
        if stats and all(s["num_retained_tokens_kept"] >= 0.9 * args.retained_tokens for s in stats.values()):
            return t
    return None


def report(records: list, samples: list, final: dict, args) -> bool:
    statuses: dict[int, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    num = len(records)
    backpressure = statuses.get(429, 0) + statuses.get(503, 0)
    unexpected_5xx = sum(v for k, v in statuses.items() if k >= 500 and k != 503)
    errors_in_stream = sum(1 for r in records if r.status == 200 and r.error)
    hung = sum(r.hung for r in records)
    print(f"\nrequests {num}: by status {dict(sorted(statuses.items()))}; disconnected on purpose "
          f"{sum(r.disconnected for r in records)}; error events inside 200 streams {errors_in_stream}; hung {hung}")
    print(f"{'minute':>6} {'requests':>8} {'ttft p50':>9} {'ttft p99':>9} {'gap p50':>8} {'gap p99':>8}   (ms)")
    for minute in range(int(args.minutes) + 1):
        batch = [r for r in records if minute * 60 <= r.start < (minute + 1) * 60]
        ttfts = [r.ttft * 1e3 for r in batch if r.ttft is not None]
        gaps = [g * 1e3 for r in batch for g in r.gaps]
        if batch:
            print(f"{minute:>6} {len(batch):>8} {percentile(ttfts, .5):>9.0f} {percentile(ttfts, .99):>9.0f} "
                  f"{percentile(gaps, .5):>8.0f} {percentile(gaps, .99):>8.0f}")
    warm = warmed_up_at(samples, args)
    flat = True
    for rid in final:
        rss = [s[rid]["num_resident_bytes"] / 2**20 for t, s in samples if rid in s and warm is not None and t >= warm]
        if len(rss) >= 2:
            med = statistics.median(rss)
            spread = max(abs(x - med) / med for x in rss)
            flat &= spread <= 0.10
            print(f"replica {rid}: RSS after warm-up ({warm:.0f} s) {min(rss):.0f}-{max(rss):.0f} MiB, "
                  f"median {med:.0f}, max deviation {100 * spread:.1f}%")
        else:
            flat = False
            print(f"replica {rid}: the caches never all reached their caps (warm-up at {warm}); no flatness figure")
    idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in final.values())
    no_blocks = all(s["num_blocks_used"] == 0 for s in final.values())
    checks = {"0 unexpected 5xx": unexpected_5xx == 0, "backpressure <= 5%": backpressure <= 0.05 * num,
              "0 hung streams": hung == 0, "replicas idle at the end": idle, "no KV block in use at the end": no_blocks,
              "RSS flat after warm-up (+-10%)": flat}
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print(f"backpressure (429 + 503): {backpressure} of {num} ({100 * backpressure / max(num, 1):.2f}%)")
    return all(checks.values())


def plot(records: list, samples: list, path: str, warm: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    replica_ids = sorted({rid for _, s in samples for rid in s})
    for (ax, key, label, scale) in ((axes[0][0], "num_resident_bytes", "resident memory (MiB)", 2**20),
                                    (axes[0][1], "num_blocks_used", "KV blocks in use", 1),
                                    (axes[1][0], "num_retained_tokens_kept", "retained tokens", 1)):
        for rid in replica_ids:
            points = [(t, s[rid][key] / scale) for t, s in samples if rid in s and key in s[rid]]
            ax.plot([p[0] for p in points], [p[1] for p in points], label=f"replica {rid}")
        ax.set_title(label)
        if warm is not None:
            ax.axvline(warm, color="grey", linestyle=":")
        ax.legend(fontsize=7)
    buckets: dict[int, list[float]] = {}
    for r in records:
        for g in r.gaps:
            buckets.setdefault(int(r.start // 30), []).append(g * 1e3)
    xs = sorted(buckets)
    axes[1][1].plot([x * 30 for x in xs], [percentile(buckets[x], .5) for x in xs], label="p50")
    axes[1][1].plot([x * 30 for x in xs], [percentile(buckets[x], .99) for x in xs], label="p99")
    axes[1][1].set_title("gap between stream chunks (ms), per 30 s")
    axes[1][1].legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"plot: {path}")


async def run(args, handle) -> tuple[list, list]:
    records, samples = [], []
    t0 = time.perf_counter()
    deadline = t0 + args.minutes * 60
    await asyncio.gather(sampler(handle, args.replicas, deadline, samples, t0),
                         *(client_loop(k, deadline, records, t0, args.port) for k in range(args.clients)))
    return records, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--retained-tokens", type=int, default=65536)
    parser.add_argument("--port", type=int, default=8125)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "reliability_soak.png"))
    args = parser.parse_args()
    local_ray_defaults()
    print(f"{host_line()}; {args.clients} clients, {args.replicas} replicas, {args.minutes} min")
    handle = start_app(args)
    records, samples = asyncio.run(run(args, handle))
    time.sleep(5.0)  # aborted and finishing work lands
    final = replica_stats(handle, args.replicas)
    ok = report(records, samples, final, args)
    try:
        plot(records, samples, args.plot, warmed_up_at(samples, args))
    except ImportError:  # not a test dependency: the figure is optional, the checks above are the result
        print("no figure: `pip install matplotlib` for it")
    print("SOAK PASS" if ok else "SOAK FAIL")


if __name__ == "__main__":
    main()
