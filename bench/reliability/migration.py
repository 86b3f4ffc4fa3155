"""What a conversation keeps when its replica leaves: scale-in, a rolling update and an app roll, through Serve.

    python -m bench.reliability.migration [--model tiny|default] [--conversations 12] [--turns 3] [--only NAME ...]

testing/migration.py's scenario (tests/ray/test_migration.py asserts it): one local Serve app deployed as
`serve deploy` deploys it, 3 ModelReplicas; `--conversations` chats of `--turns` turns each; then one change,
then one more turn of every conversation. Per scenario, with migration on and off (`migration.enabled`): the
next turn's prompt tokens computed vs the new tokens it added (a kept prefix computes new + at most one block),
the share of prompt tokens served from cache, time to the answer, failed requests, and the StateDepot's
counters. A light load (one client chatting on two conversations every 0.2 s) runs through every change:
"kept_during_change" counts its turns that computed at most new + one block while the change ran (a turn
that arrives between the router dropping a leaving replica and that replica's export recomputes).
  scale-in   `deployments: [{name: ModelReplica, num_replicas: 2}]`: one replica leaves.
  rolling    a ray_actor_options change restarts every replica one by one; the StateDepot stays (its
             version is unchanged).
  app-roll   a changed `args` (engine.stream_interval) gives every deployment a new version: the depot
             rolls too and hands its states to its successor.
"""

import argparse
import statistics
import time

from bench.common import host_line, local_ray_defaults
from testing.migration import (APP, BLOCK, ROLLED_OPTIONS, app_config, deploy, light_load, new_tokens, next_turn,
                               start_with_conversations, wait_for)

SCENARIOS = ("scale-in", "rolling", "app-roll")


def start_ray() -> None:
    import ray
    from ray import serve

    from serve_app.local_server import free_port

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})


def config(model: str, port: int, migration: bool, deployments=None, stream_interval: int = 4) -> dict:
    cfg = app_config(model, port, deployments)
    cfg["args"] = {**cfg["args"], "migration": {"enabled": migration},
                   "engine": {**cfg["args"]["engine"], "stream_interval": stream_interval}}
    return cfg


def change(name: str, model: str, port: int, migration: bool) -> dict:
    if name == "scale-in":
        return config(model, port, migration, [{"name": "ModelReplica", "num_replicas": 2}])
    if name == "rolling":
        return config(model, port, migration, [{"name": "ModelReplica", "ray_actor_options": ROLLED_OPTIONS}])
    return config(model, port, migration, stream_interval=2)


def run(name: str, model: str, migration: bool, num_conversations: int, num_turns: int) -> dict:
    from ray import serve

    from serve_app.local_server import free_port

    port = free_port()  # the fast path: the app's Ingress answers HTTP itself
    app, conversations, old = start_with_conversations(config(model, port, migration), num_conversations,
                                                       num_turns, timeout_s=300)
    started = time.monotonic()
    with light_load(app, conversations[:2]) as (failures, during):
        deploy(change(name, model, port, migration))
        survivors = wait_for(2 if name == "scale-in" else 3, gone=set() if name == "scale-in" else old,
                             timeout_s=300)
        took = time.monotonic() - started
    moved = [c for c in conversations if c["turns"][-1]["replica"] not in survivors]
    rows = []
    for conversation in conversations:
        start = time.monotonic()
        result = next_turn(app, conversation)
        rows.append((len(result["prompt"]) - result["cached"], new_tokens(conversation),
                     result["cached"], len(result["prompt"]), time.monotonic() - start, conversation in moved))
    depot = serve.get_deployment_handle("StateDepot", app_name=APP).depot_stats.remote().result() \
        if migration else {}
    serve.delete(APP)
    summary = summarize(name, migration, rows, failures, took, depot)
    summary["kept_during_change"] = f"{sum(c <= n + BLOCK for c, n in during)}/{len(during)}"
    return summary


def summarize(name, migration, rows, failures, took, depot) -> dict:
    moved = [r for r in rows if r[5]]
    return {"scenario": name, "migration": "on" if migration else "off", "change_s": round(took, 1),
            "failed": len(failures), "moved": len(moved),
            "kept_prefix": f"{sum(r[0] <= r[1] + BLOCK for r in moved)}/{len(moved)}",
            "computed_per_new_moved": round(sum(r[0] for r in moved) / max(1, sum(r[1] for r in moved)), 2),
            "cached_share_all": round(sum(r[2] for r in rows) / sum(r[3] for r in rows), 3),
            "next_turn_s_moved": round(statistics.median([r[4] for r in moved]), 3) if moved else None,
            "depot": {k: v for k, v in depot.items() if k in ("num_states_received", "num_states_taken")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"],
                        help="tiny (random weights) or default (SmolLM2-135M)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=SCENARIOS)
    args = parser.parse_args()
    local_ray_defaults()
    model = tiny_model() if args.model == "tiny" else str(prepared_default())
    start_ray()
    print(host_line())
    for name in args.only or SCENARIOS:
        for migration in (True, False):
            print(run(name, model, migration, args.conversations, args.turns), flush=True)


def tiny_model() -> str:
    import tempfile
    from pathlib import Path

    from testing.tiny_models import make_tiny_llama

    return str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny-migration-")), prepared_default()))


def prepared_default():
    from model_files.prepare import prepare_model

    return prepare_model("default", progress=False)


if __name__ == "__main__":
    main()
