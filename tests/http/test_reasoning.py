"""Reasoning through the openai client: a tiny Qwen3 with Qwen3's published template whose greedy reply is
`<think>x</think>y`, split into reasoning_content 'x' and content 'y', streamed and not, n = 2, with
include_reasoning false, with enable_thinking false (all content), with Qwen3.5's template (the prompt opened
<think>: the reply is 'x</think>y'), and retained across turns whichever parts the client sends back.

How the reply is made deterministic: a bigram model. Every layer's o_proj and down_proj are zeroed, so the
last hidden state is norm(embedding of the current token) whatever came before; the head's rows are zero except
row next(t) = that hidden state of t, scaled. Greedy then follows the chain token by token (the right row's
logit is |h_t| x scale; any other chain row's is smaller by Cauchy-Schwarz; every other token's is 0).
"""

from pathlib import Path

import openai
import pytest
import torch

from testing.family_tokenizers import TEMPLATE_DIR
from tests.http.conftest import MODEL

USER = [{"role": "user", "content": "Think, then answer."}]
SCALE = 50.0


def make_chain_model(out_dir: Path, base_dir: Path, template: str, chain: list[str], *starts: str) -> Path:
    """A tiny Qwen3 (Qwen3's tokenizer, `template`) whose greedy next token after chain[i] is chain[i + 1], and
    after each of `starts` is chain[0]."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from testing.tiny_families import make_tiny_family

    make_tiny_family("qwen3", out_dir, base_dir, tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    tokenizer.chat_template = (TEMPLATE_DIR / f"{template}.jinja").read_text()
    tokenizer.save_pretrained(str(out_dir))
    model = Qwen3ForCausalLM.from_pretrained(str(out_dir)).float()
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in chain]
    edges = [*zip(ids, ids[1:]), *((vocab[t], ids[0]) for t in starts)]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for current, following in edges:
            hidden = model.model.norm(model.model.embed_tokens.weight[current])
            head[following] = SCALE * hidden / hidden.norm()
    model.save_pretrained(str(out_dir))
    return out_dir


def last_prompt_token(template: str, tokenizer_dir: Path, **kwargs) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                   chat_template=(TEMPLATE_DIR / f"{template}.jinja").read_text(), **kwargs)
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)[-1])


@pytest.fixture(scope="module")
def qwen3(smollm2_dir, tiny_family, tmp_path_factory, start_server):
    """Qwen3's template: the model opens <think> itself; the prompt's last token ('\n' thinking on, '\n\n'
    off) -> <think>."""
    base = tiny_family("qwen3")
    starts = last_prompt_token("qwen3", base), last_prompt_token("qwen3", base, enable_thinking=False)
    chain = ["<think>", "x", "</think>", "y", "<|im_end|>"]
    model = make_chain_model(tmp_path_factory.mktemp("chain-qwen3"), smollm2_dir, "qwen3", chain, *starts)
    return client_of(start_server(own_replica=True, model=str(model)))


@pytest.fixture(scope="module")
def qwen3_5(smollm2_dir, tiny_family, tmp_path_factory, start_server):
    """Qwen3.5's template: the generation prompt ends '<think>\\n', so the reply is 'x</think>y'."""
    start = last_prompt_token("qwen3_5", tiny_family("qwen3"))
    model = make_chain_model(tmp_path_factory.mktemp("chain-qwen3_5"), smollm2_dir, "qwen3_5",
                             ["x", "</think>", "y", "<|im_end|>"], start)
    return client_of(start_server(own_replica=True, model=str(model)))


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0,
                                          extra_body=extra)


def streamed(client, n: int = 1, **extra) -> list[dict]:
    """Per choice: reasoning and content joined from the chunks, the chunks' delta keys, the finish reason."""
    out = [{"reasoning": "", "reasoning_content": "", "content": "", "keys": set(), "finish": None}
           for _ in range(n)]
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0, n=n,
                                                stream=True, extra_body=extra):
        for choice in chunk.choices:
            delta, acc = choice.delta.to_dict(), out[choice.index]
            acc["keys"] |= set(delta)
            for key in ("reasoning", "reasoning_content", "content"):
                acc[key] += delta.get(key) or ""
            acc["finish"] = choice.finish_reason or acc["finish"]
    return out


def test_reasoning_and_content_split(qwen3):
    response = chat(qwen3, return_token_ids=True, logprobs=True)
    message = response.choices[0].message.to_dict()
    assert message["reasoning_content"] == message["reasoning"] == "x"
    assert message["content"] == "y" and response.choices[0].finish_reason == "stop"
    # logprobs list every generated token, reasoning and tags included
    assert [e.token for e in response.choices[0].logprobs.content] == ["<think>", "x", "</think>", "y"]
    assert response.usage.completion_tokens_details.reasoning_tokens == 3  # up to and including </think>


def test_streamed_split_equals_the_body(qwen3):
    (choice,) = streamed(qwen3)
    assert (choice["reasoning_content"], choice["reasoning"], choice["content"]) == ("x", "x", "y")
    assert choice["finish"] == "stop" and "<think>" not in choice["content"]


def test_n_2_each_choice_split_on_its_own(qwen3):
    response = qwen3.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0, n=2)
    assert [(c.message.to_dict()["reasoning_content"], c.message.content) for c in response.choices] == \
        [("x", "y")] * 2
    assert [(c["reasoning_content"], c["content"]) for c in streamed(qwen3, n=2)] == [("x", "y")] * 2


def test_include_reasoning_false_drops_it(qwen3):
    message = chat(qwen3, include_reasoning=False).choices[0].message.to_dict()
    assert message["content"] == "y" and "reasoning_content" not in message and "reasoning" not in message
    (choice,) = streamed(qwen3, include_reasoning=False)
    assert choice["content"] == "y" and not choice["keys"] & {"reasoning", "reasoning_content"}


def test_thinking_closed_by_the_prompt_is_all_content(qwen3):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(qwen3, **kwargs).choices[0].message.to_dict()
    assert message["content"] == "<think>x</think>y" and message.get("reasoning_content") is None
    (choice,) = streamed(qwen3, **kwargs)
    assert choice["content"] == "<think>x</think>y" and choice["reasoning_content"] == ""


def test_prompt_that_opened_think(qwen3_5):
    response = chat(qwen3_5, return_token_ids=True)
    message = response.choices[0].message.to_dict()
    assert (message["reasoning_content"], message["content"]) == ("x", "y")
    assert response.usage.completion_tokens_details.reasoning_tokens == 2  # 'x', '</think>': no '<think>' made
    (choice,) = streamed(qwen3_5)
    assert (choice["reasoning_content"], choice["content"]) == ("x", "y")


@pytest.mark.parametrize("sent_back", ["content", "reasoning_content", "reasoning"])
def test_next_turn_is_retained_whichever_parts_come_back(qwen3, sent_back):
    first = qwen3.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0,
                                          extra_body={"user": sent_back})
    message = first.choices[0].message.to_dict()
    reply = {"role": "assistant", "content": message["content"]}
    if sent_back != "content":  # either name of the reasoning field
        reply[sent_back] = message["reasoning_content"]
    second = qwen3.chat.completions.create(
        model=MODEL, messages=USER + [reply, {"role": "user", "content": "And again."}], max_tokens=10,
        temperature=0, extra_body={"user": sent_back})
    assert second.usage.prompt_tokens_details.to_dict()["retention"] == "retained"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3_5"])
def test_json_schema_constrains_the_answer_not_the_reasoning(fixture, request):
    """Qwen3 (the model may open <think>: an optional free think block, then the schema) and Qwen3.5 (the prompt
    opened it: free until </think>): the reasoning is the model's own 'x', the content valid JSON."""
    import json

    import jsonschema

    client = request.getfixturevalue(fixture)
    response = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}})
    message = response.choices[0].message.to_dict()
    assert message["reasoning_content"] == "x"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert response.choices[0].finish_reason == "stop"
