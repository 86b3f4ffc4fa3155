"""A hybrid (Qwen3.5-text) checkpoint served by the same routes: chat, streaming, a retained second turn."""

import openai
import pytest


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_dir, start_server):
    return start_server(own_replica=True, model=str(tiny_hybrid_dir))


def test_hybrid_model_serves_chat_and_keeps_turn_ids(hybrid):
    client = openai.OpenAI(base_url=hybrid.base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello hybrid!"}]
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True}).to_dict()
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) \
        == one["choices"][0]["message"]["content"]
    follow_up = messages + [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "And then?"}]
    two = client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True}).to_dict()
    kept = one["prompt_token_ids"] + one["choices"][0]["token_ids"]
    assert two["usage"]["prompt_tokens_details"]["retention"] == "retained"
    assert two["prompt_token_ids"][:len(kept)] == kept
    # No state checkpoints yet: the whole prompt is recomputed, and usage says so.
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
