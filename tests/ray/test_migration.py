"""Conversations survive a replica's removal (issue 17), through Serve itself.

An app deployed as `serve deploy` deploys it (the controller's apply_config with a ServeDeploySchema, the
REST API's path), beside the session's app: 8 conversations x 3 turns on 3 replicas; then the same config
with `deployments: [{name: ModelReplica, num_replicas: 2}]`, so Serve removes one replica, which exports
its conversations to the StateDepot as it leaves; the router chooses among the survivors. The 4th turn of
every conversation computes at most its new tokens + one block (the survivors' own counters agree with
usage), and its greedy tokens equal a cold engine's for the same ids. The hybrid model: the earlier turns
never run through the linear layers again. Then a rolling update (a ray_actor_options change restarts every
replica) under a light load: no request fails, and every conversation keeps its computed prefix.
"""

import threading
import time

import httpx
import pytest

from serve_app.local_server import free_port
from tests.ray.conftest import MODEL, stats_of_each, wait_until_routed_to_each

APP = "migrate"
BLOCK = 16
NUM_CONVERSATIONS = 8
PORT = free_port()


def app_config(model_dir, deployments: list[dict] | None = None) -> dict:
    return {"name": APP, "route_prefix": f"/{APP}", "import_path": "serve_app.app:build_app",
            "args": {"model": str(model_dir), "served_model_name": MODEL, "num_replicas": 3, "dtype": "float32",
                     "replica_num_cpus": 0, "engine": {"num_threads": 1}, "ingress": {"http_port": PORT}},
            "deployments": deployments or []}


def deploy(config: dict) -> None:
    """What `serve deploy config.yaml` does, without the dashboard's HTTP hop."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema(applications=[config]))


def replica_ids() -> set[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name.rsplit("#", 1)[-1] for name in names if f"{APP}#ModelReplica#" in name}


def wait_for(replicas: int, gone: set[str] = frozenset(), timeout_s: float = 120.0) -> set[str]:
    """Until the app runs `replicas` ModelReplicas, none of `gone` alive (their export is done by then)."""
    from ray import serve

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        app = serve.status().applications.get(APP)
        ids = replica_ids()
        if app is not None and app.status == "RUNNING" and len(ids) == replicas and not ids & gone:
            deployment = app.deployments["ModelReplica"]
            if deployment.replica_states.get("RUNNING", 0) == replicas:
                return ids
        time.sleep(0.5)
    raise AssertionError(f"the app did not reach {replicas} replicas: {serve.status().applications.get(APP)}")


def chat(base: str, messages: list[dict]) -> dict:
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
                             "return_token_ids": True})
    reply.raise_for_status()
    body = reply.json()
    details = body["usage"]["prompt_tokens_details"]
    return {"text": body["choices"][0]["message"]["content"], "prompt": body["prompt_token_ids"],
            "completion": body["choices"][0]["token_ids"], "cached": details["cached_tokens"],
            "retention": details["retention"], "replica": reply.headers.get("x-tether-replica")}


def spread_over(ids: list[str], count: int = NUM_CONVERSATIONS) -> list[str]:
    """First messages of `count` conversations whose rendezvous owners cover every replica (at least
    two each), so whichever replica Serve removes holds conversations."""
    from core.hashing import rendezvous_owner, route_key

    texts, per_replica, i = [], dict.fromkeys(ids, 0), 0
    while len(texts) < count:
        text = f"Conversation {i}: name three rivers."
        owner = rendezvous_owner(route_key("", MODEL, messages=[{"role": "user", "content": text}]), ids)
        if per_replica[owner] < 2 or min(per_replica.values()) >= 2:
            texts.append(text)
            per_replica[owner] += 1
        i += 1
    return texts


def next_turn(base: str, conversation: dict) -> dict:
    result = chat(base, conversation["messages"])
    k = len(conversation["turns"])
    conversation["turns"].append(result)
    conversation["messages"] += [{"role": "assistant", "content": result["text"]},
                                 {"role": "user", "content": f"Turn {k + 2}: more about item {k}, please."}]
    return result


def new_tokens(conversation: dict) -> int:
    """Of the last turn: prompt ids past the previous turn's prompt + reply."""
    prev, cur = conversation["turns"][-2:]
    return len(cur["prompt"]) - len(prev["prompt"]) - len(prev["completion"])


def replica_stats(ids: set[str]) -> dict[str, dict]:
    return stats_of_each(ids, APP)


def cold_completion(model_dir, prompt: list[int]) -> list[int]:
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine
    from tests.engine.conftest import greedy, run_all

    return run_all(Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256)),
                   [greedy("cold", prompt, max_tokens=8)])["cold"]


@pytest.fixture
def conversations_on_three(serve_app):
    from ray import serve

    def start(model_dir) -> tuple[str, list[dict], set[str]]:
        deploy(app_config(model_dir))
        ids = wait_for(3)
        base = f"http://127.0.0.1:{PORT}"  # the fast path: its Ingress answers HTTP itself
        wait_until_routed_to_each(base, sorted(ids))
        conversations = [{"messages": [{"role": "user", "content": text}], "turns": []}
                         for text in spread_over(sorted(ids))]
        for _ in range(3):
            for conversation in conversations:
                next_turn(base, conversation)
        return base, conversations, ids
    yield start
    serve.delete(APP)


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_scale_in_moves_every_conversation_to_a_survivor(conversations_on_three, model, tiny_llama_dir,
                                                         tiny_hybrid_dir):
    model_dir = tiny_llama_dir if model == "llama" else tiny_hybrid_dir
    base, conversations, before = conversations_on_three(model_dir)
    held = {c["turns"][-1]["replica"] for c in conversations}
    deploy(app_config(model_dir, [{"name": "ModelReplica", "num_replicas": 2}]))
    survivors = wait_for(2)
    [victim] = before - survivors
    assert victim in held, "no conversation lived on the removed replica: nothing would move"
    start = replica_stats(survivors)
    for conversation in conversations:
        result = next_turn(base, conversation)
        assert result["replica"] in survivors
        computed = len(result["prompt"]) - result["cached"]
        # Hybrid: the new ids and the last reply token only; the linear layers never see the history again.
        assert computed <= new_tokens(conversation) + (2 if model == "hybrid" else BLOCK), conversation["turns"]
        assert result["retention"] == "retained"
        assert result["completion"] == cold_completion(model_dir, result["prompt"])
    end = replica_stats(survivors)
    computed = sum(end[r]["num_prompt_tokens_computed"] - start[r]["num_prompt_tokens_computed"] for r in survivors)
    assert computed == sum(len(c["turns"][-1]["prompt"]) - c["turns"][-1]["cached"] for c in conversations)
    assert sum(end[r]["num_states_imported"] for r in survivors) >= sum(
        c["turns"][-2]["replica"] == victim for c in conversations)
    if model == "llama":
        rolling_update_keeps_every_prefix(base, conversations, model_dir, survivors)


def rolling_update_keeps_every_prefix(base: str, conversations: list[dict], model_dir, old: set[str]) -> None:
    """A ray_actor_options change restarts every replica, one by one, while a client keeps chatting."""
    failures, stop = [], threading.Event()

    def light_load():
        i = 0
        while not stop.is_set():
            try:
                next_turn(base, conversations[i % 4])
            except Exception as exc:  # counted: the promise is 0 failed requests
                failures.append(repr(exc))
            i += 1
            time.sleep(0.2)

    load = threading.Thread(target=light_load)
    load.start()
    try:
        deploy(app_config(model_dir, [{"name": "ModelReplica", "num_replicas": 2,
                                       "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": {
                                           "TETHER_ROLLED": "1"}}}}]))
        wait_for(2, gone=old)
    finally:
        stop.set()
        load.join()
    assert failures == []
    for conversation in conversations:
        result = next_turn(base, conversation)
        assert result["retention"] == "retained", conversation["turns"]
        assert len(result["prompt"]) - result["cached"] <= new_tokens(conversation) + BLOCK
