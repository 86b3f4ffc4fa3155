"""`/health` asks the replica, cheaply: 200 while its engine can serve, 503 in OpenAI's error shape once it cannot.
(tests/ray/test_startup_failure.py covers the Serve side: no replica started at all.)"""

import httpx
import pytest


def test_health_is_503_once_the_engine_stopped(start_server):
    server = start_server(own_replica=True)
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
    server.replica.engine.shutdown()  # its step thread ends: the replica's check_health now fails
    reply = httpx.get(f"{server.base_url}/health", timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["type"] == "server_unavailable"
    assert error["message"].startswith("no model replica can serve: engine step loop failed")


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
