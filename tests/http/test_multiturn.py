"""Turn N costs only what turn N added: retained ids, prefix reuse and the engine's own counters,
through the openai client against the real engine."""

import httpx
import openai
import pytest

from testing.tiny_models import with_chat_template
from tests.http.conftest import MODEL

BLOCK = 16  # the engine's default block size
QWEN_STYLE_TEMPLATE = (
    # Drops reasoning from assistant turns before the last user message; the last assistant turn and the
    # generation prompt carry an empty think block, as Qwen3 templates write it.
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)


def turn(client, messages, **extra) -> dict:
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"return_token_ids": True, **extra})
    body = response.to_dict()
    details = body["usage"]["prompt_tokens_details"]
    return {"text": body["choices"][0]["message"]["content"], "prompt": body["prompt_token_ids"],
            "completion": body["choices"][0]["token_ids"], "prompt_tokens": body["usage"]["prompt_tokens"],
            "cached": details["cached_tokens"], "retained": details["retained_tokens"],
            "retention": details["retention"]}


def converse(client, server, first: str, num_turns: int, **extra) -> list[dict]:
    """A conversation; each turn records what the engine's counter says it computed."""
    messages, turns = [{"role": "user", "content": first}], []
    for k in range(num_turns):
        before = server.replica.engine_stats()["num_prompt_tokens_computed"]
        result = turn(client, messages, **extra)
        result["computed"] = server.replica.engine_stats()["num_prompt_tokens_computed"] - before
        turns.append(result)
        messages += [{"role": "assistant", "content": result["text"]},
                     {"role": "user", "content": f"Turn {k + 2}: tell me more about item {k} of the list."}]
    return turns


def check_each_turn_costs_only_what_it_added(turns: list[dict]) -> None:
    assert turns[0]["retention"] == "first turn"
    for prev, cur in zip(turns, turns[1:]):
        kept = prev["prompt"] + prev["completion"]
        assert cur["prompt"][:len(kept)] == kept  # the exact ids of the previous turn, then the new ones
        assert cur["retention"] == "retained" and cur["retained"] >= len(kept)
        num_new = len(cur["prompt"]) - len(kept)
        assert cur["computed"] <= num_new + BLOCK
        assert cur["cached"] == cur["prompt_tokens"] - cur["computed"]  # usage agrees with the counter


def test_six_turns_cost_only_what_each_added(client, http):
    check_each_turn_costs_only_what_it_added(converse(client, http, "Hello! Name three rivers.", 6))


@pytest.fixture(scope="module")
def qwen_style(tiny_llama_dir, tmp_path_factory, start_server):
    """The tiny model with a test-local template that rewrites earlier turns."""
    model_dir = with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("qwen-style"), QWEN_STYLE_TEMPLATE)
    return start_server(own_replica=True, model=str(model_dir))


def test_template_that_rewrites_history_still_costs_only_what_was_added(qwen_style):
    client = openai.OpenAI(base_url=qwen_style.base_url + "/v1", api_key="unused", max_retries=0)
    turns = converse(client, qwen_style, "Hello! Name three rivers.", 4)
    check_each_turn_costs_only_what_it_added(turns)
    tok = qwen_style.server.renderer.tokenizer
    think = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    # The reply the model produced sits in its think-block turn; the re-render dropped that block.
    assert turns[1]["prompt"][len(turns[0]["prompt"]) - len(think):len(turns[0]["prompt"])] == think
    rerendered = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Hello! Name three rivers."}, {"role": "assistant", "content": turns[0]["text"]},
         {"role": "user", "content": "x"}], tokenize=False), add_special_tokens=False)
    assert rerendered[:len(turns[0]["prompt"])] != turns[0]["prompt"]


def test_reply_that_does_not_survive_reencoding(client, http):
    tok = http.server.renderer.tokenizer
    for i in range(20):  # build one: a reply whose re-rendered history differs from the ids used
        first = f"Say something odd, number {i}."
        one = turn(client, [{"role": "user", "content": first}], retain_token_ids=False)
        history = [{"role": "user", "content": first}, {"role": "assistant", "content": one["text"]}]
        rerendered = tok.encode(tok.apply_chat_template(history, tokenize=False), add_special_tokens=False)
        if rerendered[:len(one["prompt"]) + len(one["completion"])] != one["prompt"] + one["completion"]:
            break
    else:
        pytest.fail("no reply in 20 failed to round-trip")
    assert tok.encode(tok.decode(one["completion"]), add_special_tokens=False) != one["completion"] \
        or rerendered[:len(one["prompt"])] != one["prompt"]
    follow_up = history + [{"role": "user", "content": "And then?"}]
    kept = one["prompt"] + one["completion"]
    off = turn(client, follow_up, retain_token_ids=False)
    assert off["retention"] == "off" and off["prompt"][:len(kept)] != kept  # re-rendered: diverges
    on_first = turn(client, [{"role": "user", "content": first}])  # same reply, now retained
    assert on_first["completion"] == one["completion"]
    on = turn(client, follow_up)
    assert on["retention"] == "retained" and on["prompt"][:len(kept)] == kept  # keeps the ids it used


def test_callers_never_share_retained_ids(client, start_server):
    first = [{"role": "user", "content": "Isolation check: pick a colour."}]
    alice = turn(client, first, user="alice")
    follow_up = first + [{"role": "assistant", "content": alice["text"]}, {"role": "user", "content": "Why?"}]
    assert turn(client, follow_up, user="alice")["retention"] == "retained"
    bob = turn(client, follow_up, user="bob")
    assert bob["retention"] == "miss" and bob["retained"] == 0
    assert turn(client, follow_up)["retention"] == "miss"  # anonymous is a namespace of its own
    secured = start_server(ingress={"api_keys": ["sk-a", "sk-b"]})
    with_key = {key: openai.OpenAI(base_url=secured.base_url + "/v1", api_key=key, max_retries=0)
                for key in ("sk-a", "sk-b")}
    a1 = turn(with_key["sk-a"], first, user="same")
    follow_up = first + [{"role": "assistant", "content": a1["text"]}, {"role": "user", "content": "Why?"}]
    assert turn(with_key["sk-a"], follow_up, user="same")["retention"] == "retained"
    other = turn(with_key["sk-b"], follow_up, user="same")  # same `user`, another key: another caller
    assert other["retention"] == "miss" and other["retained"] == 0


def test_edited_history_falls_back_to_the_render(client):
    first = [{"role": "user", "content": "Edit check: count to three."}]
    one = turn(client, first)
    edited = first + [{"role": "assistant", "content": one["text"] + " (edited)"}, {"role": "user", "content": "Ok"}]
    result = turn(client, edited)
    assert result["retention"] == "miss" and result["retained"] == 0


def test_tokenize_counts_what_a_generation_sees(raw, client):
    messages = [{"role": "user", "content": "Count my tokens, please."}]
    generated = turn(client, messages, retain_token_ids=False)
    for prefix in ("", "/v1"):
        tokens = raw.post(f"{prefix}/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert tokens["count"] == generated["prompt_tokens"] and tokens["tokens"] == generated["prompt"]
        text = raw.post(f"{prefix}/detokenize", json={"model": MODEL, "tokens": [9906, 905]}).json()["prompt"]
        assert raw.post(f"{prefix}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] \
            == [9906, 905]
    assert raw.post("/tokenize", json={"model": MODEL}).status_code == 400
    assert raw.post("/detokenize", json={"tokens": [10 ** 9]}).json()["error"]["param"] == "tokens"


def test_completions_and_stream_return_token_ids(client, http):
    body = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                     extra_body={"return_token_ids": True}).to_dict()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == http.server.renderer.encode_prompt("Once upon a time")
    assert len(choice["token_ids"]) == 5
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "retain_token_ids": False})
    chunks = [c.to_dict() for c in stream]
    assert "prompt_token_ids" in chunks[0]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
