"""One real local Serve app per test run: the production builder, the tiny model, 2 replicas."""

import socket

import pytest

APP = "tether"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = free_port()  # Ray's Prometheus export port for this run


@pytest.fixture(scope="session")
def metrics_url(serve_app) -> str:
    return f"http://127.0.0.1:{METRICS_PORT}/metrics"


@pytest.fixture(scope="session")
def serve_app(tiny_llama_dir):
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             _metrics_export_port=METRICS_PORT)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"model": str(tiny_llama_dir), "served_model_name": MODEL, "num_replicas": 2,
                     "dtype": "float32", "replica_num_cpus": 0, "engine": {"num_threads": 1}})
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def replica_ids(serve_app) -> list[str]:
    """The live ModelReplica ids, from Ray's named actors (independent of what responses say)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ids = sorted(name.rsplit("#", 1)[-1] for name in names if f"{APP}#ModelReplica#" in name)
    wait_until_routed_to_each(serve_app, ids)
    return ids


def wait_until_routed_to_each(base_url: str, replica_ids: list[str], timeout_s: float = 60.0) -> None:
    """serve.run returns when the replicas are healthy, but the ingress's router learns the replica set a
    moment later (Serve's long poll): requests sent before it does all go to the replicas it knows. Sends
    one-turn requests whose rendezvous owners cover every replica until each replica has served one."""
    import time

    import httpx

    from cache_router.hashing import rendezvous_owner, route_key
    from serve_app.routes import REPLICA_HEADER

    served: set[str] = set()
    deadline = time.monotonic() + timeout_s
    i = 0
    while served != set(replica_ids) and time.monotonic() < deadline:
        texts = {}  # fresh conversations each round: a conversation that landed once stays where it landed
        while len(texts) < len(replica_ids):
            text = f"warm-up {i}"
            texts.setdefault(rendezvous_owner(route_key("", MODEL, messages=[{"role": "user", "content": text}]),
                                              replica_ids), text)
            i += 1
        for text in texts.values():
            reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                               json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
            served.add(reply.headers.get(REPLICA_HEADER))
        time.sleep(0.2)
    assert served == set(replica_ids), f"after {timeout_s} s the ingress routes only to {served}"
