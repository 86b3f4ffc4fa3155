"""A real HTTP server (uvicorn on a loopback port) over the real engine on the tiny model.

The routes are the production ones (`make_api`); the only difference from a Serve
deployment is the backend: one in-process ModelReplica instead of a Ray handle.
"""

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from replicas.deployment import ModelReplica
from serve_app.backend import LocalBackend
from serve_app.config import AppConfig
from serve_app.routes import OpenAIServer, make_api

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, server: OpenAIServer, replica: ModelReplica):
        self.server, self.replica = server, replica
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_api(server), host="127.0.0.1", port=self.port, log_level="warning")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._uvicorn.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self):
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Engine stats once nothing runs or waits (aborts land at the next step)."""
        deadline = time.time() + timeout
        while True:
            stats = self.replica.engine_stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 or time.time() > deadline:
                return stats
            time.sleep(0.02)


@pytest.fixture(scope="package")
def replica(tiny_llama_dir):
    config = AppConfig(model=str(tiny_llama_dir), dtype="float32")
    replica = ModelReplica(config.engine.model_dump())
    yield replica
    replica.engine.shutdown()


@pytest.fixture(scope="package")
def start_server(tiny_llama_dir, replica):
    servers = []

    def start(**overrides) -> RunningServer:
        config = AppConfig(model=str(tiny_llama_dir), served_model_name=MODEL, dtype="float32", **overrides)
        running = RunningServer(OpenAIServer.from_config(config, LocalBackend(replica)), replica)
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.stop()


@pytest.fixture(scope="package")
def http(start_server) -> RunningServer:
    return start_server()


@pytest.fixture
def client(http):
    import openai

    return openai.OpenAI(base_url=http.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def raw(http):
    with httpx.Client(base_url=http.base_url, timeout=60) as c:
        yield c
