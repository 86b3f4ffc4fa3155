"""Step 3's protocol through the openai client on the real engine: every parameter changes the output
the way it should; n fans out into indexed choices with one usage."""

import json
import math

import pytest

from tests.http.conftest import MODEL

HELLO = [{"role": "user", "content": "Tell me a story about a dragon."}]


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", HELLO), **kwargs)


def greedy_ids(client, **kwargs) -> list[int]:
    body = chat(client, max_tokens=8, temperature=0, extra_body={"return_token_ids": True,
                                                                   **kwargs.pop("extra_body", {})}, **kwargs)
    return body.to_dict()["choices"][0]["token_ids"]


def test_logit_bias_forces_a_token(client):
    plain = greedy_ids(client)
    forced = plain[3] + 7
    assert greedy_ids(client, logit_bias={str(forced): 100}) == [forced] * 8


def test_min_tokens_forces_length_and_stop_token_ids_stop(client):
    plain = greedy_ids(client)
    stop_at = plain[1]
    stopped = greedy_ids(client, extra_body={"stop_token_ids": [stop_at]})
    assert stopped == plain[:plain.index(stop_at) + 1]
    longer = greedy_ids(client, extra_body={"stop_token_ids": [stop_at], "min_tokens": 5})
    assert len(longer) >= 5 and stop_at not in longer[:4]
    exact = chat(client, max_tokens=6, temperature=0, extra_body={"min_tokens": 6, "ignore_eos": False})
    assert exact.usage.completion_tokens == 6


def runner_up_logprobs(client, forced: int, **kwargs) -> list[tuple[str, float]]:
    """Forces `forced` every step (logit_bias +100) and returns, per step, the runner-up and its logprob.
    The forced token holds all the mass, so a penalty on it shifts every other logprob by exactly its size."""
    body = chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                logit_bias={str(forced): 100}, **kwargs)
    return [(e.top_logprobs[1].token, e.top_logprobs[1].logprob) for e in body.choices[0].logprobs.content]


def test_penalties_act_on_generated_tokens_by_their_size(client):
    forced = greedy_ids(client)[0]
    base = runner_up_logprobs(client, forced)
    presence = runner_up_logprobs(client, forced, presence_penalty=1.5)
    frequency = runner_up_logprobs(client, forced, frequency_penalty=0.5)
    repetition = runner_up_logprobs(client, forced, extra_body={"repetition_penalty": 1.5})
    for step in range(4):  # the forced token has been generated `step` times before this step
        assert presence[step][0] == frequency[step][0] == base[step][0]
        assert math.isclose(presence[step][1] - base[step][1], 1.5 if step else 0.0, abs_tol=1e-3)
        assert math.isclose(frequency[step][1] - base[step][1], 0.5 * step, abs_tol=1e-3)
    assert all(abs(repetition[step][1] - base[step][1]) > 1e-3 for step in range(1, 4))


def test_n_choices_indexed_with_one_usage(client):
    one = chat(client, max_tokens=6, temperature=1.0, seed=11)
    three = chat(client, max_tokens=6, temperature=1.0, seed=11, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content  # choice 0 keeps the seed
    assert len({c.message.content for c in three.choices}) > 1  # derived seeds differ
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 18
    again = chat(client, max_tokens=6, temperature=1.0, seed=11, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]


def test_n_streamed_interleaves_choices_with_one_usage_and_one_done(raw):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with raw.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [e.removeprefix("data: ") for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 15
    texts = {i: "" for i in range(3)}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert len(set(texts.values())) == 1  # greedy: the same text in every choice, each complete
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]


def test_chat_logprobs_match_content_tokens(client):
    body = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                extra_body={"return_token_ids": True})
    entries = body.choices[0].logprobs.content
    assert len(entries) == len(body.to_dict()["choices"][0]["token_ids"]) == 6
    # A character split across tokens is whole only in the joined bytes (its pieces alone spell U+FFFD);
    # a last piece whose character never completed has no text.
    joined = bytes(b for e in entries for b in e.bytes).decode("utf-8", errors="ignore")
    assert joined == body.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-5)  # greedy took the top one
        assert e.bytes == list(e.token.encode()) or e.token == "\ufffd"  # a piece of a character


def test_completion_echo_and_logprobs(client, http):
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                       echo=True, logprobs=2)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 4 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0  # prompt logprobs bypass the cache


def test_request_id_fingerprint_continue_final_message_and_suffix(client, raw):
    body = chat(client, max_tokens=3, temperature=0, extra_body={"request_id": "my-request-7"})
    assert body.id == "my-request-7" and body.system_fingerprint
    assert body.usage.completion_tokens_details.reasoning_tokens == 0
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, the dragon"}]
    cont = chat(client, messages=prefix, max_tokens=4, temperature=0,
                extra_body={"continue_final_message": True, "add_generation_prompt": False,
                            "return_token_ids": True})
    ids = cont.to_dict()["prompt_token_ids"]
    assert http_tokenizer_decode(raw, ids).endswith("Well, the dragon")  # continued, no new turn opened
    error = raw.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "return 1"}).json()
    assert error["error"]["param"] == "suffix"  # SmolLM2's vocabulary has no FIM tokens


def http_tokenizer_decode(raw, ids) -> str:
    return raw.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_truncation_parameters_reduce_sampling_to_greedy(client):
    plain = greedy_ids(client)
    hot = dict(max_tokens=8, extra_body={"return_token_ids": True})

    def hot_ids(**extra):
        body = chat(client, temperature=2.0, seed=5, **hot | {"extra_body": {**hot["extra_body"], **extra}})
        return body.to_dict()["choices"][0]["token_ids"]

    assert hot_ids() != plain  # temperature 2 wanders off the greedy path
    assert hot_ids() == hot_ids()  # the same seed, the same draw
    assert hot_ids(top_k=1) == plain and hot_ids(min_p=1.0) == plain
    body = chat(client, temperature=2.0, seed=5, top_p=1e-6, **hot)
    assert body.to_dict()["choices"][0]["token_ids"] == plain


def test_stop_string_kept_with_include_stop_str_in_output(client):
    text = chat(client, max_tokens=12, temperature=0).choices[0].message.content
    stop = text[4:7]
    cut = chat(client, max_tokens=12, temperature=0, stop=[stop])
    kept = chat(client, max_tokens=12, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert kept.choices[0].message.content == text[:text.find(stop) + len(stop)]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"


def test_special_tokens_shown_when_not_skipped_and_ignore_eos(client, http):
    eos = http.server.renderer.tokenizer.eos_token_id
    forced_eos = {str(eos): 100}  # EOS every step
    stopped = chat(client, max_tokens=5, temperature=0, logit_bias=forced_eos)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == ""
    shown = chat(client, max_tokens=3, temperature=0, logit_bias=forced_eos,
                 extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.usage.completion_tokens == 3 and shown.choices[0].message.content == "<|im_end|>" * 3


def test_prompt_logprobs_on_completions(client, http):
    ids = http.server.renderer.encode_prompt("The cat sat on the mat")
    body = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1}).to_dict()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every prompt position computed
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0  # the prompt's own token
        assert 1 <= len(entry) <= 2


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[1]"),
    ({"response_format": {"type": "json_schema"}}, "response_format"), ({"best_of": 3}, "best_of"),
    ({"max_tokens": 10 ** 6}, "max_tokens"),
])
def test_every_bad_value_answers_400_naming_its_field(raw, body, param):
    response = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_completion_400s(raw):
    for body, param in [({"logprobs": 6}, "logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"suffix": "x"}, "suffix")]:
        response = raw.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
