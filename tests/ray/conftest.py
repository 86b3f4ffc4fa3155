"""One real local Serve app per test run: the production builder, the tiny model, 2 replicas."""

import pytest

from serve_app.local_server import free_port
from testing.routing_warmup import wait_until_routed_to_each

APP = "tether"
MODEL = "tiny"


METRICS_PORT = free_port()  # Ray's Prometheus export port for this run
HEAD_RESOURCE = "tether-head"  # only the session's first node has it: what must stay on the head asks for it


@pytest.fixture(scope="session")
def metrics_url(serve_app) -> str:
    return f"http://127.0.0.1:{METRICS_PORT}/metrics"


PROXY_PORT = free_port()  # Serve's HTTP proxy: the old path, and the other apps' route prefixes


@pytest.fixture(scope="session")
def serve_app(tiny_llama_dir):
    """The session app's fast path: its Ingress answers HTTP itself (configs/local.yaml's default)."""
    from serve_app.local_ray import start_local_app, stop_local_app

    args = {"model": str(tiny_llama_dir), "served_model_name": MODEL, "num_replicas": 2, "dtype": "float32",
            "replica_num_cpus": 0, "engine": {"num_threads": 1}}
    yield start_local_app(args, free_port(), proxy_port=PROXY_PORT, app_name=APP, runtime_env=None,
                          _node_ip_address="127.0.0.1", _metrics_export_port=METRICS_PORT,
                          resources={HEAD_RESOURCE: 64})
    stop_local_app()


@pytest.fixture(scope="session")
def proxy_url(serve_app) -> str:
    """Serve's proxy: the session app at /, other apps at /<name>."""
    return f"http://127.0.0.1:{PROXY_PORT}"


@pytest.fixture(scope="session")
def replica_ids(serve_app) -> list[str]:
    """The live ModelReplica ids, from Ray's named actors (independent of what responses say)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ids = sorted(name.rsplit("#", 1)[-1] for name in names if f"{APP}#ModelReplica#" in name)
    wait_until_routed_to_each(serve_app, ids, MODEL)
    return ids


def stats_of_each(ids, app: str = APP) -> dict[str, dict]:
    """replica id -> its engine_stats, for each of `ids` (ModelReplicas of `app`)."""
    from ray import serve

    handle, stats = serve.get_deployment_handle("ModelReplica", app_name=app), {}
    for _ in range(100):  # keyless calls go to the least loaded replica: ask until each answered
        one = handle.engine_stats.remote().result()
        stats[one["replica_id"]] = one
        if set(stats) >= set(ids):
            return stats
    raise AssertionError(f"replicas {set(ids) - set(stats)} never answered")
