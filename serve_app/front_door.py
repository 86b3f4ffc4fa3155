"""FrontDoor: the Ingress replica's own HTTP server, so no proxy process stands between a client and it.

Through Serve's proxy every streamed chunk crosses one more process (client -> proxy -> Ingress -> replica:
an ASGI message per chunk, pickled and sent back over a Ray stream); on 2 cores that process takes the CPU
the engine's threads then lack (docs/benchmarks.md, "The Serve path"). With `ingress.http_port` set, each
Ingress replica serves the same FastAPI app itself, with uvicorn on a thread of its own:

- the socket is bound with SO_REUSEPORT, so several Ingress replicas on one node, and the old and new
  replica of a rolling update, share the port and the kernel spreads connections over them;
- leaving (`close`): the listener closes first (new connections go to the other replicas), then the
  requests in flight finish, for at most `drain_timeout_s`;
- everything behind the FastAPI app (validation, rendering, the router, fan-out, limits, metrics) is the
  same code as through the proxy: only the hop is gone.

Serve's own proxy may still run on another port (`http_options.port`): the old path, for comparison.
"""

import logging
import socket
import threading
import time

import uvicorn

logger = logging.getLogger("ray.serve")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class FrontDoor:
    def __init__(self, app, host: str, port: int, drain_timeout_s: float = 30.0):
        self.host, self.port = host, port
        self.drain_timeout_s = drain_timeout_s
        self._socket = reuse_port_socket(host, port)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout_s,
                                lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="tether-front-door", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the ingress's HTTP server did not start on {host}:{port}")
            time.sleep(0.01)
        logger.info("Ingress: serving HTTP on %s:%d (no proxy hop)", host, port)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stops accepting, lets the requests in flight finish (at most drain_timeout_s), then returns."""
        self._server.should_exit = True
        self._thread.join(timeout=self.drain_timeout_s + 5)
