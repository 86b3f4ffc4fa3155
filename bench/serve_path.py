"""What the Ray Serve path adds to time to first token: engine alone vs a no-op request vs the real thing.

    python bench/serve_path.py [--prompt-tokens 100] [--reps 20] [--max-tokens 1] [--text] [--model default]
                               [--threads 2]

Three measurements of the same kind of request (a `--prompt-tokens` token-id prompt, unique per
repetition so every one is a cold prefill; with --text, English text of that many tokens, as the peers
bench sends, which the ingress tokenizes and the engine gets tokenized the same way; greedy, --max-tokens
output tokens, timed to the first),
interleaved repetition by
repetition so that machine noise hits all three alike:
- engine:  the replica's AsyncEngine in this process: `generate()` called -> first delta;
- no-op:   HTTP POST /v1/completions (streamed) through the production path -- Serve's proxy ->
           Ingress (validation, rendering) -> handle -> ConversationRouter -> replica actor -> back --
           where the replica is `NoopReplica`, which answers at once without a model: the cost of
           the path itself;
- serve:   the same request through the production app (`build_app`, one ModelReplica).
The claim it checks (issue 7): median serve TTFT <= median engine TTFT + median no-op TTFT + 5 ms.
Both Serve apps run side by side in one Ray instance (routes / and /noop); the replica gets all
`--threads` threads, as does the in-process engine (only one of them works at a time).
"""

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from replicas.messages import GenerateDelta, GenerateRequest, SamplingParams  # noqa: E402

SLACK_S = 0.005  # what the issue allows the path beyond engine + no-op
SETTLE_S = 0.2  # after a measurement that leaves tokens to generate (--max-tokens > 1), before the next one


class NoopReplica:
    """The ModelReplica contract with no model: one token at once. Measures the Serve path alone."""

    def __init__(self, model_info: dict):
        self.info = model_info

    async def generate(self, request: GenerateRequest):
        yield GenerateDelta(request.request_id, [0], "x", finish_reason="length",
                            num_prompt_tokens=len(request.prompt_token_ids), num_generated_tokens=1,
                            replica_id="noop")

    def model_info(self) -> dict:
        return self.info

    def record_routing_stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "blocks": [], "conversations": []}


def unique_prompt(vocab_size: int, length: int, rep: int) -> list[int]:
    """Token ids that share no leading block with any other repetition's (a cold prefill each time)."""
    return [(1000 + rep * 7919 + i * 31) % (vocab_size - 1000) + 500 for i in range(length)]


def text_prompts(model: str, length: int):
    """rep -> (text, its token ids as the ingress encodes a completions prompt): English, unique per rep."""
    from bench.peer_workloads import long_prompt_builder
    from replicas.models.prepare import prepare_model
    from serve_app.render import Renderer

    build, renderer = long_prompt_builder(), Renderer(str(prepare_model(model, progress=False)))

    def prompt(rep: int) -> tuple[str, list[int]]:
        nonce = f"Request {rep}-{time.time_ns()}."
        text = build(nonce, length)
        return text, renderer.encode_prompt(text)

    return prompt


async def engine_ttft(engine, prompt: list[int], rep: int, max_tokens: int) -> float:
    request = GenerateRequest(f"engine-{rep}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    start = time.perf_counter()
    stream = engine.generate(request)
    try:
        await anext(stream)
        return time.perf_counter() - start
    finally:
        await stream.aclose()


def http_ttft(client: httpx.Client, prefix: str, model: str, prompt: str | list[int], max_tokens: int = 1) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{prefix}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # the first event that carries the token (its text may be empty)
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and (choices[0]["text"] or choices[0]["finish_reason"]):
                    return time.perf_counter() - start
    raise RuntimeError(f"no content from {prefix or '/'}")


def deploy(args) -> tuple[str, dict]:
    from ray import serve

    from serve_app.app import Ingress, build_app, router_config
    from serve_app.config import AppConfig

    spec = {"model": args.model, "served_model_name": "bench", "num_replicas": 1, "dtype": args.dtype,
            "replica_num_cpus": 0, "engine": {"num_threads": args.threads}}
    serve.run(build_app(spec), name="tether", route_prefix="/")
    info = serve.get_deployment_handle("ModelReplica", app_name="tether").model_info.remote().result()
    config = AppConfig(**spec)
    noop = serve.deployment(NoopReplica, name="NoopReplica").options(request_router_config=router_config(config))
    ingress = serve.deployment(Ingress, name="Ingress").options(ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(config.model_dump(), noop.bind(info)), name="noop", route_prefix="/noop")
    return spec["served_model_name"], info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--text", action="store_true", help="English text prompts (tokenized by the ingress)")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens each request generates (the no-op: 1); "
                        "with more, the engine keeps decoding while the first token travels back")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()

    import ray
    from ray import serve

    from replicas.config import EngineConfig
    from replicas.engine.async_engine import AsyncEngine
    from replicas.engine.engine import Engine
    from replicas.models.prepare import prepare_model

    ray.init(num_cpus=max(2, args.threads), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    logging.getLogger("httpx").setLevel(logging.WARNING)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    model, info = deploy(args)
    config = EngineConfig(model=str(prepare_model(args.model, progress=False)), dtype=args.dtype)
    engine = AsyncEngine(lambda: Engine(config), args.threads)
    vocab = engine.engine.tokenizer.vocab_size
    text_prompt = text_prompts(args.model, args.prompt_tokens) if args.text else None
    loop = asyncio.new_event_loop()
    times = {"engine": [], "no-op": [], "serve": []}
    with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as client:
        for rep in range(-2, args.reps):  # two warm-up repetitions, not counted
            if text_prompt:
                prompt, prompt_ids = text_prompt(rep)
            else:
                prompt = prompt_ids = unique_prompt(vocab, args.prompt_tokens, rep + 2)
            sample = {"engine": loop.run_until_complete(engine_ttft(engine, prompt_ids, rep, args.max_tokens))}
            time.sleep(SETTLE_S)  # the aborted request's last step ends before the next measurement
            sample["no-op"] = http_ttft(client, "/noop", model, prompt)
            sample["serve"] = http_ttft(client, "", model, prompt, args.max_tokens)
            time.sleep(SETTLE_S)
            if rep >= 0:
                for name, seconds in sample.items():
                    times[name].append(seconds)
    engine.shutdown()
    serve.shutdown()
    ray.shutdown()
    report(times, info, args)


def report(times: dict, info: dict, args) -> None:
    med = {name: statistics.median(values) for name, values in times.items()}
    kind = "text" if args.text else "token-id"
    print(f"\n{args.prompt_tokens}-token {kind} prompt, {args.max_tokens} output tokens, {info['dtype']}, "
          f"{args.threads} threads, "
          f"medians of {args.reps} (ms):")
    print("| path | TTFT p50 | min | max |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {med[name] * 1e3:.1f} | {min(values) * 1e3:.1f} | {max(values) * 1e3:.1f} |")
    added = med["serve"] - med["engine"] - med["no-op"]
    print(f"\nserve - engine - no-op = {added * 1e3:+.1f} ms (allowed: +{SLACK_S * 1e3:.0f} ms): "
          f"{'PASS' if added <= SLACK_S else 'FAIL'}")


if __name__ == "__main__":
    main()
