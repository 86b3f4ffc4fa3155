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
    return sorted(name.rsplit("#", 1)[-1] for name in names if f"{APP}#ModelReplica#" in name)
