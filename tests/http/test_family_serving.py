"""Every supported family served end to end (the real engine behind the real routes, the openai client), on its
tiny checkpoint with the family's tokenizer and published chat template (testing/tiny_families.py):
chat rendered by the family's template, multi-turn with retention (turn k computes at most the new tokens and
one block), n = 2, logprobs."""

import openai
import pytest

from testing.tiny_families import FAMILIES
from tests.http.conftest import MODEL
from tests.http.test_multiturn import check_each_turn_costs_only_what_it_added, converse

FIRST = "Hello! Name three rivers of Europe and say which seas they reach."


@pytest.fixture(scope="module", params=[*FAMILIES, "gemma3_multimodal"])
def family_server(request, tiny_family, start_server):
    return request.param, start_server(own_replica=True, model=str(tiny_family(request.param)))


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_is_rendered_by_the_family_template(family_server):
    family, server = family_server
    tok = server.server.renderer.tokenizer
    messages = [{"role": "user", "content": FIRST}]
    body = client_of(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                     extra_body={"return_token_ids": True}).to_dict()
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert body["prompt_token_ids"] == expected
    header = {"llama3": "<|start_header_id|>", "gemma3": "<start_of_turn>", "gemma3_multimodal": "<start_of_turn>",
              "mistral": "[INST]", "phi3": "<|user|>"}.get(family, "<|im_start|>")
    assert tok.convert_tokens_to_ids(header) in expected  # the family's own control token, one id
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_multi_turn_costs_only_what_each_turn_added(family_server):
    _, server = family_server
    check_each_turn_costs_only_what_it_added(converse(client_of(server), server, FIRST, 3))


def test_n_2_with_logprobs(family_server):
    _, server = family_server
    response = client_of(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": FIRST}], n=2, max_tokens=5, temperature=1.0, seed=7,
        logprobs=True, top_logprobs=2)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    for choice in response.choices:
        entries = choice.logprobs.content
        assert len(entries) >= 1
        for entry in entries:
            assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert response.usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)
