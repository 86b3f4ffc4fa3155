"""What the Ray Serve path costs per streamed token, path by path, with no model in the way.

    python -m bench.serve_path.serve_path [--paths proxy,direct,channel] [--streams 1,8,32] [--tokens 64]
                                          [--step-ms 8] [--reps 3] [--stream-interval 1] [--json PATH]

The replica is the production ModelReplica whose engine is `StepEngine`: every `--step-ms` it gives each
running request one token (a step that sleeps, so the path's own CPU is all there is to measure). The
ingress is the production Ingress. Each path runs in a fresh local Ray instance, and for each,
`--streams` concurrent streaming /v1/completions of `--tokens` tokens (16-token id prompts):

  proxy    Serve's HTTP proxy -> Ingress -> handle -> replica, every delta its own Ray stream item
           (`ingress.http_port` unset, `ingress.delta_channels` off: the path before issue 23)
  direct   the Ingress answers HTTP itself (`ingress.http_port`, serve_app/front_door.py); deltas still
           one Ray stream item each (`delta_channels` off)
  channel  the fast path, configs/local.yaml's default: direct, and deltas over the replica's delta
           channel, one frame per engine step for every stream of the caller (replicas/delta_channel.py)

Reported per path and stream count (medians over --reps):
- each role's CPU with no request in flight (% of one core): what it takes from the engine anyway;
- CPU ms per delivered token of each process (proxy, ingress, replica, the rest of Ray, the client);
  at 1 stream these include each process's standing load over the run (the idle row), spread per token;
- TTFT above one step (what the path adds to the first token);
- the inter-chunk gap p50 / p99 of each stream, against the step period.
The host's CPU flags are printed first.
"""

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import psutil

from bench.common import ROOT, host_line, local_ray_defaults, percentile, write_json
from core.messages import GenerateDelta, GenerateRequest

PROMPT_TOKENS = 16


class StepEngine:
    """The Engine surface AsyncEngine drives, with no model: each step takes `step_s` and gives every running
    request its next token, until its max_tokens."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.running: dict[str, tuple[GenerateRequest, int]] = {}
        self.grammars = self.vision = None

    def check_request(self, request: GenerateRequest) -> None:
        pass

    def add_request(self, request: GenerateRequest, grammar=None) -> None:
        self.running[request.request_id] = (request, 0)

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def take_failures(self) -> list:
        return []

    def step(self) -> list[GenerateDelta]:
        time.sleep(self.step_s)
        deltas = []
        for request_id, (request, made) in list(self.running.items()):
            made += 1
            done = made >= request.sampling.max_tokens
            deltas.append(GenerateDelta(request_id, [100 + made % 50], " x", "length" if done else None,
                                        len(request.prompt_token_ids), 0, made,
                                        prompt_token_ids=request.prompt_token_ids if made == 1 else None))
            if done:
                del self.running[request_id]
            else:
                self.running[request_id] = (request, made)
        return deltas


def step_replica_class(step_s: float):
    from replicas.deployment import ModelReplica
    from replicas.engine.async_engine import AsyncEngine

    class StepReplica(ModelReplica):
        def __init__(self, engine_config: dict, migration: dict | None = None, depot=None):
            from core.engine_config import EngineConfig
            from core.priority import run_at_normal_priority

            config = EngineConfig(**engine_config)
            self.engine = AsyncEngine(lambda: StepEngine(step_s), 1, config.stream_interval)
            run_at_normal_priority("StepReplica")
            self._attach({"enabled": False}, None)

        def model_info(self) -> dict:
            return {"max_model_len": 2048, "num_kv_blocks": 1024, "dtype": "none", "replica_id": self.replica_id}

        def record_routing_stats(self) -> dict:
            return {"num_running": 0, "num_waiting": 0, "blocks": [], "tier_blocks": [], "conversations": []}

    return StepReplica


# -- one path ---------------------------------------------------------------------------------------------


def serve_path(path: str, step_s: float, port: int, stream_interval: int) -> str:
    """Starts Ray + the app for `path` -> the base URL clients use."""
    import ray
    from ray import serve

    from serve_app.app import build_app_with

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    spec = {"model": "default", "served_model_name": "bench", "num_replicas": 1, "replica_num_cpus": 0,
            "migration": {"enabled": False}, "engine": {"stream_interval": stream_interval}}
    if path in ("direct", "channel"):
        serve.start(proxy_location="Disabled")
        spec["ingress"] = {"http_port": port, "delta_channels": path == "channel"}
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec["ingress"] = {"delta_channels": False}
    serve.run(build_app_with(spec, replica_class=step_replica_class(step_s)), name="tether", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_ray() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def ray_processes() -> dict[str, list[psutil.Process]]:
    """proxy, ingress, replica, ray (the rest: raylet, GCS, controller, workers), client (this process)."""
    roles: dict[str, list[psutil.Process]] = {"proxy": [], "ingress": [], "replica": [], "ray": [], "client": []}
    me = psutil.Process()
    roles["client"].append(me)
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.pid == me.pid:
            continue
        cmd = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if "haproxy" in cmd or "ProxyActor" in cmd:
            roles["proxy"].append(proc)
        elif "ServeReplica:tether:Ingress" in cmd:
            roles["ingress"].append(proc)
        elif "ServeReplica:tether:ModelReplica" in cmd:
            roles["replica"].append(proc)
        elif "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd or "default_worker" in cmd
                               or "dashboard" in cmd or "log_monitor" in cmd):
            roles["ray"].append(proc)
    return roles


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


@dataclass
class Stream:
    ttft_s: float
    gaps_s: list[float]
    tokens: int


async def one_stream(client: httpx.AsyncClient, tokens: int, rep: int) -> Stream:
    body = {"model": "bench", "prompt": [rep % 1000 + i for i in range(PROMPT_TOKENS)], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, used = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    return Stream(stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], used)


def run_streams(base_url: str, num_streams: int, tokens: int, rep: int) -> list[Stream]:
    async def run():
        limits = httpx.Limits(max_connections=num_streams + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, tokens, rep * 100 + i) for i in range(num_streams)))

    return asyncio.run(run())


def idle_load(seconds: float = 5.0) -> dict:
    """Each role's CPU with no request in flight, in % of one core: what it takes from the engine anyway."""
    roles = ray_processes()
    before = {role: cpu_seconds(procs) for role, procs in roles.items()}
    time.sleep(seconds)
    return {role: (cpu_seconds(procs) - before[role]) / seconds * 100 for role, procs in roles.items()}


def measure(base_url: str, num_streams: int, tokens: int, reps: int) -> dict:
    roles = ray_processes()
    samples = []
    run_streams(base_url, num_streams, tokens, -1)  # warm-up
    for rep in range(reps):
        before = {role: cpu_seconds(procs) for role, procs in roles.items()}
        streams = run_streams(base_url, num_streams, tokens, rep)
        delivered = sum(s.tokens for s in streams)
        cpu = {role: (cpu_seconds(procs) - before[role]) / delivered * 1e3 for role, procs in roles.items()}
        gaps = [g for s in streams for g in s.gaps_s]
        samples.append({"cpu_ms_per_token": cpu, "ttft_ms": statistics.median(s.ttft_s for s in streams) * 1e3,
                        "gap_p50_ms": percentile(gaps, 0.5) * 1e3, "gap_p99_ms": percentile(gaps, 0.99) * 1e3})
    med = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
    return {"cpu_ms_per_token": {role: statistics.median(s["cpu_ms_per_token"][role] for s in samples)
                                 for role in roles},
            "ttft_ms": med("ttft_ms"), "gap_p50_ms": med("gap_p50_ms"), "gap_p99_ms": med("gap_p99_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default="proxy,direct,channel")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=8.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stream-interval", type=int, default=1, help="engine.stream_interval")
    parser.add_argument("--port", type=int, default=8126)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    local_ray_defaults()
    print(host_line())
    results = {}
    for path in args.paths.split(","):
        base_url = serve_path(path, args.step_ms / 1e3, args.port, args.stream_interval)
        try:
            run_streams(base_url, 1, 4, -2)
            results[f"{path}/idle"] = idle_load()
            print(path, "idle % of a core", json.dumps(results[f"{path}/idle"]), flush=True)
            for num_streams in map(int, args.streams.split(",")):
                results[f"{path}/{num_streams}"] = measure(base_url, num_streams, args.tokens, args.reps)
                print(path, num_streams, json.dumps(results[f"{path}/{num_streams}"]), flush=True)
        finally:
            stop_ray()
    report(results, args)
    if args.json:
        write_json(args.json, results)


def report(results: dict, args) -> None:
    print(f"\n{args.tokens} tokens per stream, a step every {args.step_ms:g} ms, stream_interval "
          f"{args.stream_interval}, medians of {args.reps}:")
    print("| path | streams | CPU ms/token: proxy | ingress | replica | other Ray | client | "
          "TTFT - step (ms) | gap p50 | gap p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        path, streams = key.split("/")
        if streams == "idle":
            print(f"| {path} | idle, % of a core | {r['proxy']:.1f} | {r['ingress']:.1f} | {r['replica']:.1f} | "
                  f"{r['ray']:.1f} | {r['client']:.1f} | | | |")
            continue
        cpu = r["cpu_ms_per_token"]
        print(f"| {path} | {streams} | {cpu['proxy']:.2f} | {cpu['ingress']:.2f} | {cpu['replica']:.2f} | "
              f"{cpu['ray']:.2f} | {cpu['client']:.2f} | {r['ttft_ms'] - args.step_ms:.1f} | "
              f"{r['gap_p50_ms']:.1f} | {r['gap_p99_ms']:.1f} |")


if __name__ == "__main__":
    main()
