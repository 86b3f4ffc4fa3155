"""The OpenAI routes through the real engine, with the official client and raw HTTP."""

import json

import pytest

from tests.http.conftest import MODEL

HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


def sse_events(response) -> list[str]:
    """The `data:` payloads of an SSE response, checking the framing on the way."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


def test_chat_streamed_equals_not_streamed(client):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 12 and plain.choices[0].finish_reason == "length"
    assert 0 <= plain.usage.prompt_tokens_details.cached_tokens < plain.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_framing_done_and_include_usage(raw):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with raw.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    without = {**body, "stream_options": None}
    with raw.stream("POST", "/v1/chat/completions", json=without) as response:
        assert all("usage" not in json.loads(e) for e in sse_events(response)[:-1])


def test_completions_string_and_token_ids(client, http):
    tok = http.server.renderer.tokenizer
    by_text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    ids = tok.encode("The sky is", add_special_tokens=True)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == by_ids.choices[0].text


def test_stop_string_ends_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]


def test_models_health_version(raw, http):
    models = raw.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # The context advertised is the replicas' (their KV pool may cap the model's).
    assert models["data"][0]["max_model_len"] == http.replica.model_info()["max_model_len"]
    assert raw.get("/health").json() == {"status": "ok"}
    assert "version" in raw.get("/version").json()



def test_metrics_count_requests_tokens_and_latency(raw, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0)
    raw.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "temperature": -1})
    text = raw.get("/metrics").text
    counts = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert counts['tether_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert counts['tether_requests_total{route="/v1/chat/completions",status="400"}'] >= 1
    assert counts["tether_completion_tokens_total"] >= 3 and counts["tether_prompt_tokens_total"] > 0
    assert counts["tether_time_to_first_token_seconds_count"] >= 1
    assert counts["tether_inter_token_latency_seconds_count"] >= 2


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
