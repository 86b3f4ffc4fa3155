"""Serve autoscaling with conversations, on a local 3-node Ray cluster: a load ramp up (3x) and down.

    python -m bench.autoscale [--base-clients 4] [--phases 60 150 180] [--max-tokens 128] [--think-s 1]
                              [--model tiny|default] [--plot docs/autoscale.png] [--json PATH]

The head runs the Ingress and the StateDepot; three worker nodes (testing/local_nodes.py) offer one replica slot
each. The app runs `num_replicas: auto` with the autoscaling knobs below (AppConfig.autoscaling). Closed-loop
clients chat 6-turn conversations (then start a new one), streaming, `--think-s` between a reply and the next
turn (so a conversation outlives a scale-down's delay, and a removed replica's conversations continue elsewhere):
`--base-clients` of them in the steady phase, 3x as many in the up phase, back to the base in the down phase.
Reported per phase: requests, failures (any status but 200, except a 429/503 with Retry-After, counted apart),
TTFT p50/p99, and the cached share of later turns' prompts (turns 2+: cached / prompt tokens) against the steady
phase's; and the replicas over time: when the load changed, when Serve started scaling, when they were RUNNING.
"""

import argparse
import json
import threading
import time

from bench.common import host_line, local_ray_defaults, percentile, user_turn, write_json

APP = "autoscale"
SLOT = "tether-slot"
HEAD = "tether-head"
NUM_NODES = 3
TURNS = 6
AUTOSCALING = {"min_replicas": 1, "max_replicas": NUM_NODES, "target_ongoing_requests": 2,
               "upscale_delay_s": 10, "downscale_delay_s": 30, "look_back_period_s": 10,
               "metrics_interval_s": 2}


def app_config(model: str, port: int) -> dict:
    return {"name": APP, "route_prefix": f"/{APP}", "import_path": "serve_app.app:build_app",
            "args": {"model": model, "served_model_name": "m", "num_replicas": "auto", "autoscaling": AUTOSCALING,
                     "dtype": "float32", "replica_num_cpus": 0, "replica_resources": {SLOT: 1},
                     "engine": {"num_threads": 1}, "ingress": {"http_port": port},
                     "migration": {"depot_resources": {HEAD: 1}, "depot_bytes": 512 << 20}},
            "deployments": [{"name": "Ingress", "ray_actor_options": {"num_cpus": 0, "resources": {HEAD: 1}}}]}


class Load:
    """Closed-loop chat clients; `clients` is how many run now (raise or lower it at any time)."""

    def __init__(self, base: str, max_clients: int, max_tokens: int, think_s: float):
        self.base, self.clients, self.records, self.phase = base, 0, [], ""
        self.max_tokens, self.think_s = max_tokens, think_s
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(max_clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        import httpx

        http, conversation = httpx.Client(base_url=self.base, timeout=120), 0
        while not self.stop.is_set():
            if index >= self.clients:
                time.sleep(0.1)
                continue
            conversation += 1
            messages = []
            for turn in range(TURNS):
                if index >= self.clients or self.stop.is_set():
                    break
                messages.append({"role": "user", "content": user_turn(index * 1000 + conversation, turn)})
                record = self._turn(http, messages, turn)
                self.records.append(record)
                if record["status"] != 200:
                    time.sleep(float(record.get("retry_after") or 1))
                    break
                messages.append({"role": "assistant", "content": record.pop("text")})
                time.sleep(self.think_s)

    def _turn(self, http, messages: list[dict], turn: int) -> dict:
        body = {"model": "m", "messages": messages, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.monotonic()
        record = {"t": time.time(), "phase": self.phase, "turn": turn, "ttft": None, "text": ""}
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                record["status"], record["retry_after"] = response.status_code, response.headers.get("retry-after")
                record["replica"] = response.headers.get("x-tether-replica")
                if response.status_code != 200:
                    response.read()
                    return record
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["status"] = f"stream error: {event['error']['message']}"
                    for choice in event.get("choices") or []:
                        text = choice["delta"].get("content") or ""
                        if text and record["ttft"] is None:
                            record["ttft"] = time.monotonic() - start
                        record["text"] += text
                    if event.get("usage"):
                        record["prompt"] = event["usage"]["prompt_tokens"]
                        record["cached"] = event["usage"]["prompt_tokens_details"]["cached_tokens"]
        except Exception as exc:  # counted as a failure
            record["status"] = repr(exc)
        return record


def replica_states() -> dict:
    from ray import serve

    app = serve.status().applications.get(APP)
    deployment = app.deployments.get("ModelReplica") if app else None
    if deployment is None:
        return {"running": 0, "starting": 0, "stopping": 0, "trigger": "", "message": ""}
    states = deployment.replica_states
    return {"running": states.get("RUNNING", 0), "stopping": states.get("STOPPING", 0),
            "starting": states.get("STARTING", 0) + states.get("PENDING_MIGRATION", 0),
            "trigger": str(deployment.status_trigger), "message": deployment.message}


def sample_replicas(load: Load, timeline: list, stop: threading.Event) -> None:
    start = time.time()
    while not stop.is_set():
        timeline.append({"t": time.time() - start, "clients": load.clients, **replica_states()})
        time.sleep(1.0)


def summarize(records: list[dict], phases: list[str]) -> list[dict]:
    steady = later_share([r for r in records if r["phase"] == phases[0]])
    rows = []
    for phase in phases:
        ones = [r for r in records if r["phase"] == phase]
        ok = [r for r in ones if r["status"] == 200]
        told_to_retry = [r for r in ones if r["status"] in (429, 503) and r.get("retry_after")]
        share = later_share(ones)
        rows.append({"phase": phase, "requests": len(ones), "ok": len(ok), "retry_after": len(told_to_retry),
                     "failed": len(ones) - len(ok) - len(told_to_retry),
                     "ttft_p50_ms": round(1000 * percentile([r["ttft"] for r in ok if r["ttft"]], 0.5), 1),
                     "ttft_p99_ms": round(1000 * percentile([r["ttft"] for r in ok if r["ttft"]], 0.99), 1),
                     "later_turns_cached_share": round(share, 3), "vs_steady": round(share / steady, 3)})
    return rows


def later_share(records: list[dict]) -> float:
    later = [r for r in records if r["status"] == 200 and r["turn"] >= 1 and "prompt" in r]
    return sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))


def scaling_events(timeline: list[dict]) -> list[dict]:
    """Each change of the client count or the running replicas, with its time from the start."""
    events, last = [], None
    for sample in timeline:
        now = (sample["clients"], sample["running"], sample["starting"], sample["stopping"])
        if now != last:
            events.append({"t_s": round(sample["t"], 1), "clients": now[0], "running": now[1], "starting": now[2],
                           "stopping": now[3]})
            last = now
    return events


def follow_times(timeline: list[dict]) -> dict:
    """Seconds from each load change to Serve's first move (a replica starting or stopping) and to the new count
    RUNNING alone."""
    out = {}
    for i in range(1, len(timeline)):
        before, at = timeline[i - 1], timeline[i]
        if at["clients"] == before["clients"]:
            continue
        direction = "up" if at["clients"] > before["clients"] else "down"
        moved = next((s for s in timeline[i:] if s["starting"] or s["stopping"]), None)
        settled = next((s for s in timeline[i:] if moved and s["t"] > moved["t"] and not s["starting"]
                        and not s["stopping"]), None)
        out[direction] = {"load_changed_s": round(at["t"], 1),
                          "first_move_after_s": round(moved["t"] - at["t"], 1) if moved else None,
                          "settled_after_s": round(settled["t"] - at["t"], 1) if settled else None,
                          "replicas": settled["running"] if settled else None}
    return out


def plot(timeline: list[dict], records: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plot: `pip install matplotlib` for it")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["t"] for r in records)
    offset = t0 - (timeline[0]["t"] if timeline else 0)
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    top.step([s["t"] for s in timeline], [s["running"] for s in timeline], where="post", label="replicas RUNNING")
    per = max(s["clients"] for s in timeline) / max(s["running"] for s in timeline)
    top.step([s["t"] for s in timeline], [s["clients"] / per for s in timeline], where="post", linestyle="--",
             label=f"clients / {per:g} (the load)")
    top.set_ylabel("replicas")
    top.legend(loc="upper left")
    ok = [r for r in records if r["status"] == 200 and r["ttft"]]
    mid.scatter([r["t"] - offset for r in ok], [1000 * r["ttft"] for r in ok], s=3)
    mid.set_ylabel("TTFT (ms)")
    mid.set_yscale("log")
    later = [r for r in ok if r["turn"] >= 1 and r.get("prompt")]
    low.scatter([r["t"] - offset for r in later], [r["cached"] / r["prompt"] for r in later], s=3)
    low.set_ylabel("cached share (turns 2+)")
    low.set_xlabel("seconds")
    fig.suptitle("Tether on 3 local Ray nodes: num_replicas auto through a 3x load ramp")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each reply generates")
    parser.add_argument("--think-s", type=float, default=1.0, help="seconds between a reply and the next turn")
    parser.add_argument("--phases", type=float, nargs=3, default=[60, 150, 180], metavar=("STEADY", "UP", "DOWN"),
                        help="seconds of each phase")
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--plot", help="write the plot here (PNG)")
    parser.add_argument("--json", help="write the raw records and timeline here")
    args = parser.parse_args()
    local_ray_defaults()
    import ray
    from ray import serve

    from bench.reliability.migration import prepared_default, tiny_model
    from serve_app.local_server import free_port
    from testing.local_nodes import add_node
    from testing.migration import deploy

    model = tiny_model() if args.model == "tiny" else str(prepared_default())
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             resources={HEAD: 4})
    serve.start(proxy_location="Disabled")
    nodes = [add_node({SLOT: 1}) for _ in range(NUM_NODES)]
    port = free_port()
    deploy(app_config(model, port))
    while replica_states()["running"] < 1 or serve.status().applications[APP].status != "RUNNING":
        time.sleep(1)
    print(host_line())
    print(f"nodes: head + {len(nodes)} workers; autoscaling: {AUTOSCALING}")
    load = Load(f"http://127.0.0.1:{port}", 3 * args.base_clients, args.max_tokens, args.think_s)
    timeline, stop = [], threading.Event()
    sampler = threading.Thread(target=sample_replicas, args=(load, timeline, stop), daemon=True)
    sampler.start()
    phases = [("steady", args.base_clients), ("up", 3 * args.base_clients), ("down", args.base_clients)]
    for (name, clients), seconds in zip(phases, args.phases):
        load.phase, load.clients = name, clients
        time.sleep(seconds)
    load.stop.set()
    stop.set()
    rows = summarize(load.records, [name for name, _ in phases])
    for row in rows:
        print(row)
    for event in scaling_events(timeline):
        print(event)
    follow = follow_times(timeline)
    print("follow:", follow)
    depot = serve.get_deployment_handle("StateDepot", app_name=APP).depot_stats.remote().result()
    print("depot:", {k: v for k, v in depot.items() if k in ("num_states_received", "num_states_taken")})
    if args.json:
        write_json(args.json, {"rows": rows, "follow": follow, "depot": depot, "timeline": timeline,
                               "records": load.records})
    if args.plot:
        plot(timeline, load.records, args.plot)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
