"""Bad input answers 400 in OpenAI's error shape naming the field; unknown model 404; no key 401;
a full ingress 429 with Retry-After; a client that disconnects frees its blocks."""

import httpx
import pytest

from tests.http.conftest import MODEL, wait_idle

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5),
                                         ("max_tokens", 0), ("stop", 5), ("stop", [1, "x"]),
                                         ("max_completion_tokens", 0), ("n", 0), ("n", 17),
                                         ("logit_bias", {"999999": 1}), ("stop_token_ids", [-1])])
def test_bad_chat_fields_answer_400_naming_the_field(raw, field, value):
    error = error_of(raw.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_prompt_longer_than_the_context(raw, http):
    too_long = list(range(100, 100 + http.server.max_model_len + 1))
    error = error_of(raw.post("/v1/completions", json={"model": MODEL, "prompt": too_long}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * http.server.max_model_len}]}
    assert error_of(raw.post("/v1/chat/completions", json=long_chat), 400)["param"] == "messages"
    fits_alone = {**CHAT, "max_tokens": http.server.max_model_len}
    assert error_of(raw.post("/v1/chat/completions", json=fits_alone), 400)["param"] == "max_tokens"


def test_a_prompt_the_tokenizer_drops_whole_is_a_400_naming_it(raw):
    """SmolLM2's tokenizer drops control characters: "\x16" encodes to no ids (found by
    tests/unit/test_protocol_properties.py's schema fuzzing)."""
    error = error_of(raw.post("/v1/completions", json={"model": MODEL, "prompt": "\x16", "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and "no tokens" in error["message"]


def test_unknown_model_404_and_missing_field(raw):
    assert error_of(raw.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404)["param"] == "model"
    assert error_of(raw.post("/v1/chat/completions", json={"model": MODEL}), 400)["param"] == "messages"
    assert error_of(raw.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400)["param"] \
        == "prompt"


def test_api_keys(start_server):
    secured = start_server(ingress={"api_keys": ["sk-good"]})
    with httpx.Client(base_url=secured.base_url, timeout=30) as c:
        assert error_of(c.post("/v1/chat/completions", json=CHAT), 401)["code"] == "invalid_api_key"
        bad = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-bad"})
        assert error_of(bad, 401)["type"] == "authentication_error"
        ok = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-good"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        # The key is checked before the body: no field details for a caller without a key.
        assert error_of(c.post("/v1/chat/completions", json={**CHAT, "temperature": -1}), 401)
        assert error_of(c.get("/v1/models"), 401)["code"] == "invalid_api_key"


def test_null_means_default_and_unsupported_fields_are_refused(raw):
    ok = raw.post("/v1/chat/completions", json={**CHAT, "n": None, "stream": None, "temperature": None})
    assert ok.status_code == 200
    for field, value in [("functions", [{"name": "f"}])]:
        error = error_of(raw.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
        assert error["param"] == field and "not supported" in error["message"]
    assert raw.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}).status_code == 200
    bad_json = raw.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert error_of(bad_json, 400)["param"] is None


def test_full_ingress_answers_429_with_retry_after(start_server):
    small = start_server(ingress={"max_queued_requests": 1, "retry_after_s": 2})
    long_stream = {**CHAT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=small.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=long_stream) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: dropping the iterator closes the stream
            next(lines)
            refused = c.post("/v1/chat/completions", json=CHAT)
            assert error_of(refused, 429)["type"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "2"
    assert wait_idle(small)["num_running"] == 0
    # The slot is free again once the stream is gone.
    with httpx.Client(base_url=small.base_url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_frees_its_blocks(http, n):
    """A client that goes away cancels every call of its fan-out; every block comes back."""
    generated_before = http.replica.engine_stats()["num_generated_tokens"]
    body = {**CHAT, "max_tokens": 1500, "stream": True, "ignore_eos": True, "n": n}
    with httpx.Client(base_url=http.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(6 + 2 * n):
                next(lines)
            assert http.replica.engine_stats()["num_running"] == n
    stats = wait_idle(http)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_generated_tokens"] - generated_before < 1500 * n

if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
