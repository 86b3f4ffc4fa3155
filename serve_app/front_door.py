"""FrontDoor: the Ingress replica's own HTTP server, so no proxy process stands between a client and it.

Through Serve's proxy every streamed chunk crosses one more process (client -> proxy -> Ingress -> replica:
an ASGI message per chunk, pickled and sent back over a Ray stream); on 2 cores that process takes the CPU
the engine's threads then lack (docs/benchmarks.md, "The Serve path"). With `ingress.http_port` set, each
Ingress replica serves the same FastAPI app itself, with uvicorn on a thread of its own:

- the socket is bound with SO_REUSEPORT, so several Ingress replicas on one node, and the old and new
  replica of a rolling update, share the port and the kernel spreads connections over them;
- leaving (`close`): while its app is still deployed, it keeps accepting until another listener holds
  the port (a rolling update's successor, which Serve starts as this one stops; nothing queues
  connections for it as Serve's proxy did), then the listener closes and the requests in flight
  finish, for at most `drain_timeout_s` in all;
- everything behind the FastAPI app (validation, rendering, the router, fan-out, limits, metrics) is the
  same code as through the proxy: only the hop is gone.

Serve's own proxy may still run on another port (`http_options.port`): the old path, for comparison.
LocalServer (serve_app/local_server.py, no Ray) serves its app through a FrontDoor too.
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
        logger.info("serving HTTP on %s:%d (no proxy hop)", host, port)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, wait_for_successor: bool = False) -> None:
        """Stops accepting (once another listener holds the port, if `wait_for_successor`), lets the
        requests in flight finish, then returns; at most drain_timeout_s in all."""
        deadline = time.monotonic() + self.drain_timeout_s
        while wait_for_successor and num_listeners(self.port) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        self._server.should_exit = True
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()) + 5)


def num_listeners(port: int) -> int:
    """Sockets listening on `port` on this host (each SO_REUSEPORT socket is one), from /proc/net/tcp{,6}."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        count += 1
        except OSError:
            continue
    return count
