"""A real HTTP server (uvicorn on a loopback port) over the real engine on the tiny model.

The routes are the production ones (`make_api`); the only difference from a Serve
deployment is the backend: one in-process ModelReplica instead of a Ray handle.
"""

import time

import httpx
import pytest

from core.app_config import AppConfig
from replicas.deployment import ModelReplica
from serve_app.local_server import LocalServer

MODEL = "tiny"


def wait_idle(server: LocalServer, timeout: float = 10.0) -> dict:
    """Engine stats once nothing runs or waits (aborts land at the next step)."""
    deadline = time.time() + timeout
    while True:
        stats = server.replica.engine_stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 or time.time() > deadline:
            return stats
        time.sleep(0.02)


@pytest.fixture(scope="package")
def replica(tiny_llama_dir):
    replica = ModelReplica(AppConfig(model=str(tiny_llama_dir), dtype="float32").engine.model_dump())
    yield replica
    replica.engine.shutdown()


@pytest.fixture(scope="package")
def start_server(tiny_llama_dir, replica):
    """Starts a server over the shared replica, or over a replica of its own (`own_replica=True`)."""
    servers = []

    def start(own_replica: bool = False, model: str | None = None, **overrides) -> LocalServer:
        config = AppConfig(model=model or str(tiny_llama_dir), served_model_name=MODEL, dtype="float32",
                           **overrides)
        running = LocalServer(config, None if own_replica else replica)
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.stop()


@pytest.fixture(scope="package")
def http(start_server) -> LocalServer:
    return start_server()


@pytest.fixture
def client(http):
    import openai

    return openai.OpenAI(base_url=http.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def raw(http):
    with httpx.Client(base_url=http.base_url, timeout=60) as c:
        yield c
