"""Structured outputs through Ray Serve: what a grammar costs running streams.

    python -m bench.serve_path.structured [--model default] [--runs 5] [--tokens 200] [--threads 2] [--stream-late]

One Serve app (build_app, one ModelReplica) on this host; medians of --runs alternating runs:
A. throughput: 8 concurrent chat streams with a json_schema response_format (a schema of 32 required
   properties, each an object with a patterned string, an array of enums and a bounded integer: long JSON)
   vs 8 unconstrained (ignore_eos), each --tokens tokens at most; tok/s = completion tokens / wall time.
   Issue 14's target: constrained >= 0.9x unconstrained.
B. compilation off the step: 4 unconstrained streams running; their p99 gap between streamed chunks, alone
   vs while a request whose schema takes >= 100 ms to compile (measured here, on the same tokenizer) is
   submitted mid-run (not streamed, as the openai client's parse() sends it; --stream-late streams it), and
   vs a grammar-free fifth request (what any arrival costs). Target: within 1.2x. BENCH_GAPS=1 prints
   where each run's longest gaps fall.
Prints the CPU flags first.
"""

import argparse
import asyncio
import json
import logging
import os
import statistics
import time

import httpx

from bench.common import host_line, local_ray_defaults

QUESTION = [{"role": "user", "content": "Describe an imaginary warehouse inventory in detail."}]


def schema(num_properties: int, seed: int) -> dict:
    """Objects with a patterned code, an array of enums and a bounded score; `seed` makes it unique (no cache)."""
    props = {f"item_{seed}_{i}": {
        "type": "object", "additionalProperties": False, "required": ["code", "tags", "score"], "properties": {
            "code": {"type": "string", "pattern": f"^[A-Z]{{2}}-[0-9]{{{2 + i % 5}}}$"},
            "tags": {"type": "array", "items": {"enum": [f"t{seed}_{i}_{j}" for j in range(6)]}, "maxItems": 4},
            "score": {"type": "integer", "minimum": 0, "maximum": 100 + i}}} for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def compile_ms(model_dir: str, spec: dict) -> float:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), cache_enabled=False)
    start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
    return (time.perf_counter() - start) * 1e3


async def stream(client, body: dict) -> tuple[int, list[float]]:
    """-> (completion tokens, arrival times of the chunks that carried text)."""
    times, num_tokens = [], 0
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return num_tokens, times


def body(model: str, tokens: int, **extra) -> dict:
    return {"model": model, "messages": QUESTION, "max_tokens": tokens, "temperature": 0, **extra}


async def throughput(client, model: str, tokens: int, constrained: bool, seed: int) -> float:
    extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "inv", "schema": schema(32, 0)}}}
             if constrained else {"ignore_eos": True})
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(client, body(model, tokens, seed=seed + i, **extra)) for i in range(8)))
    return sum(n for n, _ in results) / (time.perf_counter() - start)


async def running_p99(client, model: str, tokens: int, late: str | None, slow_schema: dict,
                      stream_late: bool) -> float:
    """p99 gap between chunks of 4 running streams; `late`: a fifth request arrives 1 s into the run, "free"
    (no grammar) or "schema" (`slow_schema`, compiled while the four run); streamed or not (`stream_late`:
    the openai client's parse() does not stream)."""
    arrival = []

    async def late_arrival():
        await asyncio.sleep(1.0)
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema}}} \
            if late == "schema" else {}
        arrival.append(time.perf_counter())
        if stream_late:
            await stream(client, body(model, 8, **extra))
        else:
            (await client.post("/v1/chat/completions", json=body(model, 8, **extra))).raise_for_status()
        arrival.append(time.perf_counter())

    start = time.perf_counter()
    tasks = [stream(client, body(model, tokens, ignore_eos=True)) for _ in range(4)]
    results = await asyncio.gather(*tasks, *([late_arrival()] if late else []))
    gaps = sorted(((b - a) * 1e3, a) for _, times in results[:4] for a, b in zip(times, times[1:]))
    if os.environ.get("BENCH_GAPS"):  # where the longest gaps fall, against the fifth request's life
        at = lambda t: round((t - start) * 1e3)  # noqa: E731
        print(f"  late={late}: arrived at {[at(t) for t in arrival]} ms (sent, answered); longest gaps "
              f"(ms @ ms): {[(round(g), at(a)) for g, a in gaps[-10:]]}")
    return gaps[int(0.99 * (len(gaps) - 1))][0]


def start_app(args) -> tuple[str, str]:
    from model_files.prepare import prepare_model
    from serve_app.local_ray import start_local_app

    model_dir = str(prepare_model(args.model, progress=False))
    spec = {"model": model_dir, "served_model_name": "bench", "num_replicas": 1, "dtype": args.dtype,
            "replica_num_cpus": args.threads, "engine": {"num_threads": args.threads}}
    start_local_app(spec, args.port, num_cpus=max(2, args.threads))  # the fast path: the Ingress answers HTTP
    return "bench", model_dir


async def measure(args, model: str) -> dict:
    results = {"json": [], "free": [], "alone": [], "late_free": [], "late_schema": []}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as client:
        await throughput(client, model, 16, False, 0)  # warm-up (and the 32-property grammar compiled once)
        await throughput(client, model, 16, True, 0)
        for run in range(args.runs):
            results["free"].append(await throughput(client, model, args.tokens, False, 100 * run))
            results["json"].append(await throughput(client, model, args.tokens, True, 100 * run))
            slow = schema(300, 1000 + run)  # a fresh schema each run: never cached
            for late in ("alone", "free", "schema"):
                results["alone" if late == "alone" else f"late_{late}"].append(await running_p99(
                    client, model, args.tokens, None if late == "alone" else late, slow, args.stream_late))
    print("per run:", {k: [round(x, 1) for x in v] for k, v in results.items()})
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--stream-late", action="store_true", help="B: the fifth request streams too")
    args = parser.parse_args()
    local_ray_defaults()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(f"{host_line()}; {args.threads} threads")
    model, model_dir = start_app(args)
    print(f"the slow schema (300 objects) compiles in {compile_ms(model_dir, schema(300, 999)):.0f} ms here "
          f"(the 32-object one in {compile_ms(model_dir, schema(32, 0)):.0f} ms)")
    med = asyncio.run(measure(args, model))
    print(f"A. 8 streams, {args.tokens} tokens: json_schema {med['json']:.1f} tok/s, unconstrained "
          f"{med['free']:.1f} tok/s, ratio {med['json'] / med['free']:.2f} (target >= 0.9)")
    how = "streamed" if args.stream_late else "not streamed"
    print(f"B. p99 gap between chunks of 4 running streams: {med['alone']:.1f} ms alone, {med['late_free']:.1f} ms "
          f"while a fifth request ({how}, no grammar) arrives, {med['late_schema']:.1f} ms while one with the slow "
          f"schema arrives (compiling): ratio to alone {med['late_schema'] / med['alone']:.2f} (target <= 1.2), "
          f"to the grammar-free arrival {med['late_schema'] / med['late_free']:.2f}")

if __name__ == "__main__":
    main()
