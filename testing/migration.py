"""Conversations across a change of replicas, through Serve: the scenario tests/ray/test_migration.py asserts
and bench/reliability/migration.py measures.

An app deployed as `serve deploy` deploys it (the controller's apply_config with a ServeDeploySchema, the REST
API's path), beside whatever else runs: 3 ModelReplicas of a model served as MODEL, its Ingress answering HTTP
on a port of its own. Conversations spread over every replica chat a few turns (start_with_conversations);
then a change is deployed (fewer replicas; ROLLED_OPTIONS, which restarts every replica) and waited out
(wait_for), under a light load of one client chatting (light_load); then each conversation's next turn
shows what it kept (new_tokens against the prompt tokens it computed).
"""

import contextlib
import threading
import time

import httpx

from core.env import ROLLED
from testing.routing_warmup import wait_until_routed_to_each

APP = "migrate"
MODEL = "tiny"  # the name the app serves its model under
BLOCK = 16  # the engine's block size: a kept prefix computes the new tokens + at most one block
NUM_CONVERSATIONS = 8
ROLLED_OPTIONS = {"num_cpus": 0, "runtime_env": {"env_vars": {ROLLED: "1"}}}  # a new code version: a rollout


def app_config(model_dir, port: int, deployments: list[dict] | None = None) -> dict:
    return {"name": APP, "route_prefix": f"/{APP}", "import_path": "serve_app.app:build_app",
            "args": {"model": str(model_dir), "served_model_name": MODEL, "num_replicas": 3, "dtype": "float32",
                     "replica_num_cpus": 0, "engine": {"num_threads": 1}, "ingress": {"http_port": port}},
            "deployments": deployments or []}


def deploy(config: dict) -> None:
    """What `serve deploy config.yaml` does, without the dashboard's HTTP hop."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema(applications=[config]))


def replica_ids(app: str = APP) -> set[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name.rsplit("#", 1)[-1] for name in names if f"{app}#ModelReplica#" in name}


def wait_for(replicas: int, gone: set[str] = frozenset(), timeout_s: float = 120.0, app: str = APP) -> set[str]:
    """Until `app` runs `replicas` ModelReplicas, none of `gone` alive (their export is done by then)."""
    from ray import serve

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = serve.status().applications.get(app)
        ids = replica_ids(app)
        if status is not None and status.status == "RUNNING" and len(ids) == replicas and not ids & gone:
            deployment = status.deployments["ModelReplica"]
            if deployment.replica_states.get("RUNNING", 0) == replicas:
                return ids
        time.sleep(0.5)
    raise AssertionError(f"the app did not reach {replicas} replicas: {serve.status().applications.get(app)}")


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


def spread_over(ids: list[str], count: int) -> list[dict]:
    """`count` new conversations whose rendezvous owners cover every replica (at least two each), so that
    whichever replica leaves holds conversations."""
    from core.hashing import rendezvous_owner, route_key

    texts, per_replica, i = [], dict.fromkeys(ids, 0), 0
    while len(texts) < count:
        text = f"Conversation {i}: name three rivers."
        owner = rendezvous_owner(route_key("", MODEL, messages=[{"role": "user", "content": text}]), ids)
        if per_replica[owner] < 2 or min(per_replica.values()) >= 2:
            texts.append(text)
            per_replica[owner] += 1
        i += 1
    return [{"messages": [{"role": "user", "content": text}], "turns": []} for text in texts]


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


def start_with_conversations(config: dict, count: int, turns: int,
                             timeout_s: float = 120.0) -> tuple[str, list[dict], set[str]]:
    """Deploys `config`, waits for its 3 replicas and until its Ingress routes to each, then chats `turns`
    turns of `count` conversations spread over them -> (the Ingress's URL, the conversations, replica ids)."""
    deploy(config)
    ids = wait_for(3, timeout_s=timeout_s)
    base = f"http://127.0.0.1:{config['args']['ingress']['http_port']}"
    wait_until_routed_to_each(base, sorted(ids), MODEL)
    conversations = spread_over(sorted(ids), count)
    for _ in range(turns):
        for conversation in conversations:
            next_turn(base, conversation)
    return base, conversations, ids


@contextlib.contextmanager
def light_load(base: str, conversations: list[dict]):
    """While the block runs, one client chats every 0.2 s, taking `conversations` in turn -> (failures,
    during): the failed turns' errors, and (computed, new) prompt tokens of each turn that succeeded."""
    failures, during, stop = [], [], threading.Event()

    def chat_until_stopped():
        i = 0
        while not stop.is_set():
            conversation = conversations[i % len(conversations)]
            try:
                result = next_turn(base, conversation)
                during.append((len(result["prompt"]) - result["cached"], new_tokens(conversation)))
            except Exception as exc:  # counted: the promise is 0 failed requests
                failures.append(repr(exc))
            i += 1
            time.sleep(0.2)

    load = threading.Thread(target=chat_until_stopped)
    load.start()
    try:
        yield failures, during
    finally:
        stop.set()
        load.join()
