"""Limits and hostile input (docs/reliability.md, "Limits"): within the limits requests complete; past them a
4xx names the field; a body past `max_body_bytes` answers 413 (declared or chunked); a client that stops
reading a stream is cut after `stream_send_timeout_s`, its generation aborted."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from core.messages import GenerateDelta, RequestError
from serve_app.fanout import _interleave
from serve_app.routes import is_known_key
from tests.http.conftest import MODEL, wait_idle
from tests.http.test_errors import error_of

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MiB = 1024 * 1024


def test_within_the_limits_requests_complete(raw):
    one_mb = raw.post("/v1/chat/completions", json={**CHAT, "metadata": {"pad": "x" * 1_000_000}})
    assert one_mb.status_code == 200, one_mb.text
    stops = raw.post("/v1/chat/completions", json={**CHAT, "stop": [f"stop{i}" for i in range(16)]})
    assert stops.status_code == 200, stops.text
    bias = raw.post("/v1/chat/completions", json={**CHAT, "logit_bias": {str(100 + i): 1 for i in range(300)}})
    assert bias.status_code == 200, bias.text
    sixteen = raw.post("/v1/chat/completions", json={**CHAT, "n": 16})
    assert sixteen.status_code == 200 and len(sixteen.json()["choices"]) == 16


@pytest.mark.parametrize("field,value", [
    ("stop", [f"s{i}" for i in range(1000)]),
    ("stop", "x" * 1025),
    ("logit_bias", {str(i): 1 for i in range(100_000)}),
    ("messages", [{"role": "user", "content": "hi"}] * 4097),
    ("messages[0].content", [{"type": "text", "text": "hi"}] * 129),
    ("chat_template_kwargs", {"chat_template": "{{ raise_exception('client template') }}"}),
])
def test_past_the_caps_answer_400_naming_the_field(raw, field, value):
    body = {**CHAT, "messages": [{"role": "user", "content": value}]} if field.startswith("messages[") \
        else {**CHAT, field: value}
    error = error_of(raw.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error", error


def test_no_field_names_a_template_a_path_or_another_model(raw):
    """The model field must be the served name; chat_template_kwargs carries template variables only."""
    for model in ("/etc/passwd", "../tiny", "other-model"):
        assert error_of(raw.post("/v1/chat/completions", json={**CHAT, "model": model}), 404)["param"] == "model"
    tokenize = raw.post("/tokenize", json={"messages": CHAT["messages"],
                                           "chat_template_kwargs": {"chat_template": "/etc/passwd"}})
    assert error_of(tokenize, 400)["param"] == "chat_template_kwargs"
    variables = raw.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert variables.status_code == 200


def test_n_times_the_whole_context_names_max_tokens(raw, http, start_server):
    whole = {**CHAT, "n": 16, "max_tokens": http.server.max_model_len}
    error = error_of(raw.post("/v1/chat/completions", json=whole), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    capped = start_server(ingress={"max_generated_tokens_per_request": 64})
    with httpx.Client(base_url=capped.base_url, timeout=60) as c:
        assert error_of(c.post("/v1/chat/completions", json={**CHAT, "n": 16, "max_tokens": 5}), 400)["param"] \
            == "max_tokens"
        assert c.post("/v1/chat/completions", json={**CHAT, "n": 16, "max_tokens": 4}).status_code == 200


def test_a_body_past_the_limit_answers_413(start_server):
    small = start_server(ingress={"max_body_bytes": 1 * MiB})
    body = json.dumps({**CHAT, "metadata": {"pad": "x" * (2 * MiB)}}).encode()

    def chunked():
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    with httpx.Client(base_url=small.base_url, timeout=60) as c:
        declared = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert error_of(declared, 413)["code"] == "request_too_large"
    with httpx.Client(base_url=small.base_url, timeout=60) as c:
        streamed = c.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert "content-length" not in streamed.request.headers
        assert error_of(streamed, 413)["code"] == "request_too_large"
        ok = c.post("/v1/chat/completions", json={**CHAT, "metadata": {"pad": "x" * 1000}})
        assert ok.status_code == 200


def test_api_keys_compare_in_constant_time():
    assert is_known_key("sk-good", ["sk-other", "sk-good"])
    assert not is_known_key("sk-goo", ["sk-good"]) and not is_known_key("", ["sk-good"])


def test_a_stuck_taker_holds_at_most_max_buffered_tokens_then_every_call_is_aborted():
    """_interleave on its own: nothing is taken after the first delta; the pumps stop pulling past the bound,
    every replica stream is closed at once, and the taker, woken later, gets what was buffered then a 408."""
    pulled, closed = [], []

    async def replica_stream(index: int):
        try:
            for step in range(1000):
                pulled.append(index)
                yield GenerateDelta(f"r{index}", [step] * 4, "abcd")
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def take_one_then_stall():
        merged = _interleave([replica_stream(0), replica_stream(1)], max_buffered_tokens=32)
        taken = [await anext(merged)]
        await asyncio.sleep(0.2)  # the sender waits on a client that does not read
        assert sorted(closed) == [0, 1] and len(pulled) <= 1 + 32 // 4 + 2
        with pytest.raises(RequestError) as cut:
            async for item in merged:
                taken.append(item)
        return taken, cut.value

    taken, error = asyncio.run(take_one_then_stall())
    assert error.status_code == 408 and "max_buffered_tokens" in error.message
    assert sum(len(delta.token_ids) for _, delta in taken[1:]) <= 32 + 4


@pytest.mark.parametrize("max_buffered_tokens", [32, 1_000_000], ids=["buffer-bound", "send-timeout"])
def test_a_client_that_stops_reading_is_cut_and_its_generation_aborted(start_server, max_buffered_tokens):
    """A raw socket with a tiny receive window sends a long streaming request and reads nothing. Its
    generation is aborted, by the buffer bound (32) or, with none in reach, by the stuck write's timeout, and
    the connection is closed once a write has waited stream_send_timeout_s."""
    slow = start_server(ingress={"stream_send_timeout_s": 0.5, "max_buffered_tokens": max_buffered_tokens})
    request = {**CHAT, "max_tokens": slow.server.max_model_len - 64, "ignore_eos": True, "stream": True,
               "n": 4, "logprobs": True, "top_logprobs": 20}  # large events fill the socket buffers quickly
    payload = json.dumps(request).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    num_generated_before = wait_idle(slow)["num_generated_tokens"]
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", slow.port))
        sock.sendall(head + payload)
        time.sleep(0.5)
        stats = wait_idle(slow, timeout=20)
        assert stats["num_running"] == 0
        # Aborted, not finished: the buffered tokens, a delta, and the steps before the abort landed.
        assert stats["num_generated_tokens"] - num_generated_before < request["n"] * request["max_tokens"]
        time.sleep(2.5)  # still not reading: the stuck write times out, the connection is closed
        received = b""
        deadline = time.time() + 20
        sock.settimeout(1.0)
        while time.time() < deadline:
            try:
                data = sock.recv(1 << 16)
            except socket.timeout:
                continue
            if not data:
                break
            received += data
        else:
            pytest.fail("the server did not close the connection")
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
