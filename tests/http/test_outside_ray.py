"""Serving in process (LocalServer, the benchmarks) never starts Ray: some Ray calls start a local instance on
first use (`ray.get_runtime_context()` does), which would then stand in the way of the Ray tests' own."""

import httpx
import pytest

from tests.http.conftest import MODEL


def test_serving_and_reading_stats_in_process_leaves_ray_off(http, replica):
    import ray

    if ray.is_initialized():  # the Ray tests ran first in this process (the suite's order runs them after)
        pytest.skip("Ray is already running in this process")
    reply = httpx.post(f"{http.base_url}/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200
    stats = replica.engine_stats()
    assert stats["node_id"] == "local" and stats["replica_id"] == "local"
    assert replica.record_routing_stats()["blocks"] is not None
    assert not ray.is_initialized()
