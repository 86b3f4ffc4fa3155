"""LocalServer: Tether without Ray: the production routes over one in-process ModelReplica, served by
uvicorn on a thread. For tests, benchmarks and quick local runs; `serve run` is the deployment path."""

import socket

from core.app_config import AppConfig
from replicas.deployment import ModelReplica
from serve_app.backend import LocalBackend
from serve_app.front_door import FrontDoor
from serve_app.routes import OpenAIServer, make_api


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, config: AppConfig, replica: ModelReplica | None = None, host: str = "127.0.0.1",
                 port: int | None = None):
        self.owns_replica = replica is None
        self.replica = replica or ModelReplica(config.engine.model_dump())
        self.server = OpenAIServer.from_config(config, LocalBackend(self.replica))
        self.port = port or free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        self._front_door = FrontDoor(make_api(self.server), host, self.port, drain_timeout_s=5.0)

    def stop(self) -> None:
        self._front_door.close()
        if self.owns_replica:
            self.replica.engine.shutdown()
