"""IngressMetrics through a tiny FastAPI app (200, 400, 401, 404, 500, SSE); ReplicaMetrics without Ray."""

import subprocess
import sys

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from replicas.metrics import ReplicaMetrics
from serve_app.metrics import IngressMetrics, TokenTimer, install_metrics


class Body(BaseModel):
    n: int


def make_app(metrics: IngressMetrics) -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    @app.post("/body")
    async def body(payload: Body):  # a bad body is FastAPI's validation error (422, or 400 with a handler)
        return {"n": payload.n}

    @app.get("/items/{item_id}")
    async def item(item_id: int):
        if item_id == 0:
            raise HTTPException(401, "no")
        return {"id": item_id}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    @app.get("/stream")
    async def stream():
        async def events():
            timer = TokenTimer(metrics)
            for i in range(3):
                timer.tick()
                yield f"data: {i}\n\n"
            metrics.tokens(prompt=5, completion=3)

        return StreamingResponse(events(), media_type="text/event-stream")

    install_metrics(app, metrics)
    return app


def scrape(client: TestClient) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text


def test_counts_by_route_template_and_status():
    metrics = IngressMetrics()
    client = TestClient(make_app(metrics), raise_server_exceptions=False)
    assert client.get("/ok").status_code == 200
    assert client.get("/ok").status_code == 200
    assert client.post("/body", json={"n": "x"}).status_code == 422
    assert client.get("/items/0").status_code == 401
    assert client.get("/items/7").status_code == 200
    assert client.get("/nowhere").status_code == 404
    assert client.get("/boom").status_code == 500
    text = scrape(client)
    assert 'tether_requests_total{route="/ok",status="200"} 2.0' in text
    assert 'tether_requests_total{route="/body",status="422"} 1.0' in text
    assert 'tether_requests_total{route="/items/{item_id}",status="401"} 1.0' in text
    assert 'tether_requests_total{route="/items/{item_id}",status="200"} 1.0' in text
    assert 'tether_requests_total{route="<unmatched>",status="404"} 1.0' in text  # bounded labels
    assert 'tether_requests_total{route="/boom",status="500"} 1.0' in text
    assert 'route="/metrics"' not in text  # scrapes are not counted
    assert "tether_requests_in_flight 0.0" in text


def test_validation_error_mapped_to_400_is_counted_as_400():
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    metrics = IngressMetrics()
    app = make_app(metrics)

    @app.exception_handler(RequestValidationError)
    async def _as_400(request, exc):
        return JSONResponse({"error": "bad"}, status_code=400)

    client = TestClient(app)
    assert client.post("/body", json={}).status_code == 400
    assert 'tether_requests_total{route="/body",status="400"} 1.0' in scrape(client)


def test_streaming_passes_through_and_observes_latencies():
    metrics = IngressMetrics()
    client = TestClient(make_app(metrics))
    with client.stream("GET", "/stream") as response:
        assert response.status_code == 200
        assert list(response.iter_lines()) == ["data: 0", "", "data: 1", "", "data: 2", ""]
    text = scrape(client)
    assert 'tether_requests_total{route="/stream",status="200"} 1.0' in text
    assert "tether_time_to_first_token_seconds_count 1.0" in text
    assert "tether_inter_token_latency_seconds_count 2.0" in text
    assert "tether_prompt_tokens_total 5.0" in text and "tether_completion_tokens_total 3.0" in text
    assert "tether_requests_in_flight 0.0" in text


def test_in_flight_while_a_stream_is_open():
    import threading

    import anyio

    metrics = IngressMetrics()
    app = make_app(metrics)
    release = threading.Event()

    @app.get("/hold")
    async def hold():
        async def events():
            yield "data: first\n\n"
            await anyio.to_thread.run_sync(release.wait)
            yield "data: last\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def in_flight() -> float:
        return metrics.registry.get_sample_value("tether_requests_in_flight")

    client = TestClient(app)
    with client.stream("GET", "/hold") as response:
        lines = response.iter_lines()
        assert next(lines) == "data: first"
        assert in_flight() == 1.0  # counted at the status line, still open while the body streams
        assert metrics.registry.get_sample_value("tether_requests_total", {"route": "/hold", "status": "200"}) == 1.0
        release.set()
        assert "data: last" in list(lines)
    assert in_flight() == 0.0


def test_instances_do_not_share_counts():
    first, second = IngressMetrics(), IngressMetrics()
    TestClient(make_app(first)).get("/ok")
    text = scrape(TestClient(make_app(second)))
    assert 'route="/ok"' not in text
    assert 'tether_requests_total{route="/ok",status="200"} 1.0' in first.render()[0].decode()


def test_render_returns_prometheus_text():
    metrics = IngressMetrics()
    metrics.request_done("/v1/chat/completions", 200)
    metrics.first_token(0.03)
    metrics.inter_token(0.012)
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain; version=")
    assert 'tether_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'tether_time_to_first_token_seconds_bucket{le="0.05"} 1.0' in text
    assert 'tether_time_to_first_token_seconds_bucket{le="0.025"} 0.0' in text
    assert 'tether_inter_token_latency_seconds_bucket{le="0.02"} 1.0' in text


def test_replica_metrics_without_ray_is_a_noop():
    # In a fresh interpreter: the Ray tests of the same run may have Ray up in this one.
    code = ("from replicas.metrics import ReplicaMetrics\n"
            "m = ReplicaMetrics('local')\n"
            "assert not m.is_enabled\n"
            "m.update({'num_prompt_tokens_computed': 10, 'num_generated_tokens': 3, 'num_running': 1,"
            " 'num_blocks': 8, 'num_free_blocks': 5, 'replica_id': 'local'})\n"
            "m.update({})\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))

