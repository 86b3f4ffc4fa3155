"""Fault drill (issue 16) cheap enough for `make test`: a replica whose engine step thread raises.

A second app beside the session's (its own route prefix, one replica) runs ModelReplica with one hook: a
request asking for FAULT_MAX_TOKENS tokens makes the engine's step raise once it has streamed a few, as a
bug in a step would, on the step thread of a real replica. Its stream ends with an SSE error event; a new
request to the replica is a 503 saying why; check_health fails, and Serve replaces the replica within 60 s,
after which requests succeed again. bench/reliability/drills.py runs the same drill under load, with the others.
"""

import json
import time

import httpx
import pytest

from serve_app.local_server import free_port
from testing.faulty_replica import faulty_replica_class
from tests.ray.conftest import MODEL

FAULTY = "faulty"
FAULT_MAX_TOKENS = 777
ARM_AFTER_TOKENS = 8
REPLACE_WITHIN_S = 60


@pytest.fixture(scope="module")
def faulty_app(serve_app, tiny_llama_dir):
    from ray import serve

    from serve_app.app import build_app_with

    port = free_port()  # the fast path: its Ingress answers HTTP itself
    app = build_app_with({"model": str(tiny_llama_dir), "served_model_name": MODEL, "num_replicas": 1,
                          "dtype": "float32", "replica_num_cpus": 0, "engine": {"num_threads": 1},
                          "ingress": {"http_port": port}},
                         replica_class=faulty_replica_class(FAULT_MAX_TOKENS, ARM_AFTER_TOKENS))
    serve.run(app, name=FAULTY, route_prefix=f"/{FAULTY}")
    yield f"http://127.0.0.1:{port}"
    serve.delete(FAULTY)


def replica_ids() -> set[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name.rsplit("#", 1)[-1] for name in names if f"{FAULTY}#ModelReplica#" in name}


def chat(text: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def test_a_replica_whose_engine_raises_fails_its_requests_with_503_and_is_replaced(faulty_app):
    from ray import serve

    [victim] = replica_ids()
    with httpx.Client(base_url=faulty_app, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat("break it", FAULT_MAX_TOKENS, True)) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        failed_at = time.monotonic()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_unavailable" and "engine failed" in error["message"]

        refused = http.post("/v1/chat/completions", json=chat("after the fault", 4, False))  # still the victim
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"].startswith(
            "the model replica cannot serve: its engine failed: RuntimeError('drill: an engine step raised')")

        deadline = failed_at + REPLACE_WITHIN_S
        while time.monotonic() < deadline:
            running = serve.status().applications[FAULTY].deployments["ModelReplica"].replica_states.get("RUNNING", 0)
            live = replica_ids()
            if running == 1 and live and victim not in live:  # a new replica, up, in the victim's place
                break
            time.sleep(0.5)
        replaced_s = time.monotonic() - failed_at
        assert replaced_s < REPLACE_WITHIN_S, f"not replaced within {REPLACE_WITHIN_S} s"
        deadline = time.monotonic() + 30  # the ingress's router hears of the new replica a moment later
        while True:
            reply = http.post("/v1/chat/completions", json=chat("after the replacement", 4, False))
            if reply.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert reply.headers["x-tether-replica"] != victim


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
