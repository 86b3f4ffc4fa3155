"""Fault drills (issue 16): a real local Serve app under streaming load, one fault at a time.

    python -m bench.reliability.drills [--model tiny|default] [--clients 8] [--max-tokens 256] [--only NAME ...]

Prints one line per drill, `PASS <name>: ...` or `FAIL <name>: ...`, with its timings, and exits 1 if any
failed. Each drill is bounded (DRILL_TIMEOUT_S); the whole run takes a few minutes on 2 cores.

Ray drills share one app (the production builder, 2 ModelReplicas, the fast path: the Ingress answers HTTP
itself, as configs/local.yaml runs it; a tiny random-weight model unless
--model default), each under `--clients` concurrent streaming chat clients; every request is a fresh
conversation, so the ConversationRouter spreads them over both replicas. "In flight" = started before the
fault and not ended by then; "new" = started after it. A request ends `ok` ([DONE] after a finish_reason),
`error-event` (an SSE error event, then [DONE]), `http-<status>`, `closed` (the connection dropped) or `hung`
(no byte for READ_TIMEOUT_S).
  replica-killed    ray.kill of the ModelReplica serving a stream. Pass: every in-flight stream ends within
                    10 s, none hangs; new requests all succeed from at most 30 s on.
  engine-raises     the engine step thread of one replica raises (FaultyReplica: a request with
                    max_tokens = FAULT_MAX_TOKENS makes its replica's step raise once it has streamed
                    ARM_AFTER_TOKENS tokens). Pass: its streams end with an error event within 10 s;
                    requests it gets meanwhile are 503s with a message; Serve replaces it (check_health)
                    within 60 s.
  rolling-update    serve.run(build_app(changed args)) on the same app name: what `serve deploy` of a changed
                    config does (the engine's stream_interval changes, so both deployments roll). Pass: 0
                    new requests fail during it; in-flight streams finish or end with an error event; none hangs.
  ingress-killed    ray.kill of the Ingress replica. Pass: in-flight streams end within 10 s; new requests
                    all succeed from at most 30 s on.
Preparation drills (no Ray; bench/reliability/prepare_drills.py):
  cache-unwritable  prepare into a read-only tmpfs, and into a full one (1 MB). Pass: exit 2 and one line
                    "error: cannot write the model cache <dir>: <why> ..." each; nothing left but the lock.
  prepare-killed    SIGKILL of `python -m model_files.prepare default` once its temporary directory
                    has the weights file. Pass: no model directory appears; the next run completes it (marker
                    present, the checkpoint loads).
Mounting tmpfs needs root (a CI container); elsewhere cache-unwritable reports SKIP.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import local_ray_defaults
from bench.reliability.prepare_drills import drill_cache_unwritable, drill_prepare_killed
from testing.faulty_replica import faulty_replica_class

APP = "drills"
MODEL = "tiny"
FAULT_MAX_TOKENS = 777
ARM_AFTER_TOKENS = 16
READ_TIMEOUT_S = 30.0
DRILL_TIMEOUT_S = 150.0
END_WITHIN_S = 10.0
RECOVER_WITHIN_S = 30.0
REPLACE_WITHIN_S = 60.0


@dataclass
class Outcome:
    start: float
    end: float = 0.0
    kind: str = "open"
    message: str = ""
    replica: str = ""
    num_events: int = 0
    last_delta: float = 0.0  # when its last content event came


@dataclass
class Load:
    """`num_clients` clients, each streaming one fresh conversation after another until stopped."""
    base_url: str
    num_clients: int
    max_tokens: int
    outcomes: list[Outcome] = field(default_factory=list)
    stopped: bool = False
    n: int = 0

    async def run(self) -> None:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.num_clients)))

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        while not self.stopped:
            self.n += 1
            await self.one(http, f"drill client {i} conversation {self.n}: count on", self.max_tokens)
            await asyncio.sleep(0.05)

    async def one(self, http: httpx.AsyncClient, text: str, max_tokens: int) -> Outcome:
        outcome = Outcome(time.monotonic())
        self.outcomes.append(outcome)
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                outcome.replica = response.headers.get("x-tether-replica", "")
                if response.status_code != 200:
                    outcome.message = (await response.aread()).decode()[:300]
                    outcome.kind = f"http-{response.status_code}"
                    return outcome
                finished = False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    outcome.num_events += 1
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        outcome.kind = "ok" if finished else outcome.kind
                        break
                    event = json.loads(data)
                    if "error" in event:
                        outcome.kind, outcome.message = "error-event", event["error"]["message"]
                    else:
                        outcome.last_delta = time.monotonic()
                        finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
                if outcome.kind == "open":
                    outcome.kind = "closed"
        except httpx.ReadTimeout:
            outcome.kind = "hung"
        except (httpx.TransportError, httpx.StreamError) as exc:
            outcome.kind, outcome.message = "closed", type(exc).__name__
        finally:
            outcome.end = time.monotonic()
        return outcome

    def in_flight(self, t0: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.start < t0 and (o.kind == "open" or o.end > t0)]

    def new(self, t0: float, t1: float = float("inf")) -> list[Outcome]:
        return [o for o in self.outcomes if t0 <= o.start < t1 and o.kind != "open"]

    def recovered_after(self, t0: float) -> float | None:
        """Seconds from t0 to the start of the first new request after which every new request succeeded."""
        new = sorted(self.new(t0), key=lambda o: o.start)
        if not new or new[-1].kind != "ok":
            return None
        i = len(new)
        while i > 0 and new[i - 1].kind == "ok":
            i -= 1
        return (new[i].start if i < len(new) else new[-1].start) - t0


def summary(outcomes: list[Outcome]) -> str:
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    return ",".join(f"{k}={v}" for k, v in sorted(kinds.items())) or "none"


def app_args(model_dir: str, port: int, stream_interval: int = 4) -> dict:
    """The fast path (the Ingress answers HTTP on `port` itself), as configs/local.yaml runs it."""
    return {"model": model_dir, "served_model_name": MODEL, "num_replicas": 2, "dtype": "float32",
            "replica_num_cpus": 0, "engine": {"num_threads": 1, "stream_interval": stream_interval},
            "ingress": {"http_port": port}}


def build(args: dict):
    from serve_app.app import build_app_with

    return build_app_with(args, replica_class=faulty_replica_class(FAULT_MAX_TOKENS, ARM_AFTER_TOKENS))


def live_replicas(deployment: str) -> set[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name.rsplit("#", 1)[-1] for name in names if f"{APP}#{deployment}#" in name}


def running_replicas(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def is_replaced(victim: str, before: set[str]) -> bool:
    """A new ModelReplica is up in the victim's place (the killed actor's name vanishes at once; Serve's
    status counts it RUNNING until the controller notices)."""
    live = live_replicas("ModelReplica")
    return victim not in live and bool(live - before) and running_replicas("ModelReplica") == 2


def kill_replica(deployment: str, replica_id: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{deployment}#{replica_id}", namespace="serve"), no_restart=True)


async def wait_for(predicate, timeout_s: float, period_s: float = 0.25) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await asyncio.to_thread(predicate):
            return time.monotonic() - start
        await asyncio.sleep(period_s)
    return None


async def with_load(base_url: str, args, drill) -> tuple[bool, str]:
    """Runs `drill(load)` (-> (passed, line)) under load, then stops the load and waits for it."""
    load = Load(base_url, args.clients, args.max_tokens)
    runner = asyncio.create_task(load.run())
    try:
        await asyncio.sleep(3.0)  # load reaches steady state
        return await asyncio.wait_for(drill(load), DRILL_TIMEOUT_S)
    finally:
        load.stopped = True
        await asyncio.wait_for(runner, READ_TIMEOUT_S + 15)


def ended_within(load: Load, flying: list[Outcome], t0: float) -> tuple[float, list[str]]:
    ends = [o.end - t0 for o in flying if o.kind != "open"]
    return max(ends, default=0.0), [o.kind for o in flying]


async def drill_replica_killed(base_url: str, args) -> tuple[bool, str]:
    async def drill(load: Load):
        victim = next(o.replica for o in reversed(load.outcomes) if o.kind == "open" and o.replica)
        before = live_replicas("ModelReplica")
        t0 = time.monotonic()
        await asyncio.to_thread(kill_replica, "ModelReplica", victim)
        replaced = await wait_for(lambda: is_replaced(victim, before), REPLACE_WITHIN_S)
        await asyncio.sleep(max(0.0, t0 + RECOVER_WITHIN_S + 5 - time.monotonic()))
        flying = [o for o in load.in_flight(t0) if o.replica == victim]
        slowest, kinds = ended_within(load, flying, t0)
        recovered = load.recovered_after(t0)
        ok = (all(k in ("ok", "error-event", "closed") for k in kinds) and slowest <= END_WITHIN_S
              and recovered is not None and recovered <= RECOVER_WITHIN_S)
        return ok, (f"{len(flying)} in-flight streams on the victim ended within {slowest:.2f} s "
                    f"({summary(flying)}); new requests all succeed from {fmt(recovered)} s after the kill "
                    f"({summary(load.new(t0))}); replaced {fmt(replaced)} s after")
    return await with_load(base_url, args, drill)


async def drill_engine_raises(base_url: str, args) -> tuple[bool, str]:
    async def drill(load: Load):
        before = live_replicas("ModelReplica")
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as http:
            trigger = await load.one(http, "drill: the request that breaks its replica", FAULT_MAX_TOKENS)
        t0, victim = trigger.last_delta, trigger.replica  # the fault: right after the trigger's last delta
        if not victim:
            return False, f"the trigger request did not stream ({trigger.kind}: {trigger.message[:120]!r})"
        replaced = await wait_for(lambda: is_replaced(victim, before), REPLACE_WITHIN_S + 30)
        t1 = time.monotonic()
        flying = [o for o in load.in_flight(t0) if o.replica == victim and o is not trigger] + [trigger]
        slowest, kinds = ended_within(load, flying, t0)
        on_victim = [o for o in load.new(t0, t1) if o.replica == victim or o.kind.startswith("http-")]
        refused = [o for o in on_victim if o.kind == "http-503"]
        clean = all(k == "error-event" or k == "ok" for k in kinds) and "engine failed" in trigger.message
        ok = (clean and slowest <= END_WITHIN_S and replaced is not None and replaced <= REPLACE_WITHIN_S
              and victim in before and all(o.kind == "http-503" and "engine failed" in o.message
                                           for o in on_victim))
        sample = refused[0].message[:90] if refused else trigger.message[:90]
        return ok, (f"{len(flying)} streams on the victim ended within {slowest:.2f} s ({summary(flying)}); "
                    f"{len(refused)} later requests it got were 503s ({summary(on_victim)}), e.g. {sample!r}; "
                    f"replaced {fmt(replaced)} s after the fault; all new requests: {summary(load.new(t0))}")
    return await with_load(base_url, args, drill)


async def drill_rolling_update(base_url: str, args, model_dir: str) -> tuple[bool, str]:
    from ray import serve

    async def drill(load: Load):
        t0 = time.monotonic()
        port = int(base_url.rsplit(":", 1)[1])
        await asyncio.to_thread(serve.run, build(app_args(model_dir, port, stream_interval=2)), name=APP,
                                route_prefix="/")
        t1 = time.monotonic()
        await asyncio.sleep(3.0)
        flying = load.in_flight(t0)
        new = load.new(t0, t1)
        failed = [o for o in new if o.kind != "ok"]
        kinds = [o.kind for o in flying]
        ok = not failed and all(k in ("ok", "error-event") for k in kinds)
        return ok, (f"serve.run of the changed app took {t1 - t0:.1f} s; {len(new)} new requests during it, "
                    f"{len(failed)} failed ({summary(new)}); {len(flying)} in flight at the start: {summary(flying)}"
                    + (f"; e.g. {failed[0].message[:90]!r}" if failed else ""))
    return await with_load(base_url, args, drill)


async def drill_ingress_killed(base_url: str, args) -> tuple[bool, str]:
    async def drill(load: Load):
        [victim] = live_replicas("Ingress")
        t0 = time.monotonic()
        await asyncio.to_thread(kill_replica, "Ingress", victim)
        await asyncio.sleep(RECOVER_WITHIN_S + 5)
        flying = load.in_flight(t0)
        slowest, kinds = ended_within(load, flying, t0)
        recovered = load.recovered_after(t0)
        ok = (all(k in ("ok", "error-event", "closed") for k in kinds) and slowest <= END_WITHIN_S
              and recovered is not None and recovered <= RECOVER_WITHIN_S)
        return ok, (f"{len(flying)} in-flight streams ended within {slowest:.2f} s ({summary(flying)}); new "
                    f"requests all succeed from {fmt(recovered)} s after the kill ({summary(load.new(t0))})")
    return await with_load(base_url, args, drill)


def fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}"


# -- main ------------------------------------------------------------------------------------------------

def start_app(args) -> tuple[str, str]:
    from model_files.prepare import prepare_model
    from serve_app.local_ray import start_local_app
    from serve_app.local_server import free_port
    from testing.tiny_models import make_tiny_llama

    smollm2 = prepare_model("default", progress=False)
    model_dir = str(smollm2) if args.model == "default" else \
        str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="drills-tiny-")), smollm2))
    port = free_port()
    start_local_app(app_args(model_dir, port), port, app_name=APP, builder=build, runtime_env=None,
                    _node_ip_address="127.0.0.1")
    return f"http://127.0.0.1:{port}", model_dir


async def run_ray_drills(args, names: list[str]) -> list[tuple[str, bool | None, str]]:
    base_url, model_dir = await asyncio.to_thread(start_app, args)
    drills = {"replica-killed": lambda: drill_replica_killed(base_url, args),
              "engine-raises": lambda: drill_engine_raises(base_url, args),
              "rolling-update": lambda: drill_rolling_update(base_url, args, model_dir),
              "ingress-killed": lambda: drill_ingress_killed(base_url, args)}
    results = []
    for name in names:
        if name not in drills:
            continue
        await wait_for(lambda: running_replicas("ModelReplica") == 2 and running_replicas("Ingress") == 1, 90)
        try:
            ok, line = await drills[name]()
        except Exception as exc:  # a drill that cannot finish is a failed drill
            ok, line = False, f"{type(exc).__name__}: {exc}"
        results.append((name, ok, line))
        report(name, ok, line)
    return results


def report(name: str, ok: bool | None, line: str) -> None:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name}: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    all_names = ["cache-unwritable", "prepare-killed", "replica-killed", "engine-raises", "rolling-update",
                 "ingress-killed"]
    parser.add_argument("--only", nargs="*", choices=all_names, default=all_names)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    local_ray_defaults()
    results = []
    for name, drill in (("cache-unwritable", drill_cache_unwritable), ("prepare-killed", drill_prepare_killed)):
        if name in args.only:
            ok, line = drill()
            results.append((name, ok, line))
            report(name, ok, line)
    if any(name in args.only for name in all_names[2:]):
        import ray
        from ray import serve

        try:
            results += asyncio.run(run_ray_drills(args, args.only))
        finally:
            serve.shutdown()
            ray.shutdown()
    sys.exit(1 if any(ok is False for _, ok, _ in results) else 0)


if __name__ == "__main__":
    main()
