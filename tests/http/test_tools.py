"""Tool calling through the openai client, on a tiny Qwen3 (its published template, `<tool_call>` one token).

A random model writes a call only when made to: `structured_outputs.choice` forces an exact reply text (the
"auto" path: the parser finds the call in whatever the model wrote), and tool_choice "required" / named
enforce the call format with serve_app/tools/grammar.py's structural tag (thinking off, so the grammar
applies from the first token). Checked: the message and delta shapes, finish_reason, streamed == not
streamed, n > 1, tool_choice "none", parallel_tool_calls false, tool turns rendered, and a template with no
tool support (SmolLM2's) getting the tools anyway.
"""

import json

import jsonschema
import openai
import pytest

from tests.http.conftest import MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
# For the grammar tests: closed values, so a random model's call ends (a free string could run to max_tokens).
CLOSED = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}}}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = '{"city": "Pa}{\\"ris", "days": 2}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + '}\n</tool_call>'
TWO_CALLS = 'Checking.\n' + CALL + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen3(tiny_family, start_server):
    server = start_server(own_replica=True, model=str(tiny_family("qwen3")))
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}, **NO_THINKING}


def create(client, stream=False, **fields):
    fields = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **fields}
    if not stream:
        return client.chat.completions.create(**fields).to_dict()
    return [chunk.to_dict() for chunk in client.chat.completions.create(stream=True, **fields)]


def assembled(chunks: list[dict], index: int = 0) -> dict:
    """A choice's chunks as one message (content, tool_calls joined by index), its finish_reason; checks each
    call's first fragment has id, type and name, and later ones argument text only."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or []:
                if part["index"] not in calls:
                    assert part["id"].startswith("call_") and part["type"] == "function"
                    calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in part and "name" not in part["function"]
                calls[part["index"]]["arguments"] += part["function"].get("arguments") or ""
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def summary(choice: dict) -> dict:
    message = choice["message"]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls") or []]
    return {"content": message["content"], "calls": calls, "finish_reason": choice["finish_reason"]}


def test_auto_reads_the_call_the_model_wrote(qwen3):
    body = create(qwen3, extra_body=forced("I will check.\n" + CALL))
    message = body["choices"][0]["message"]
    assert message["content"] == "I will check."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    streamed = assembled(create(qwen3, stream=True, extra_body=forced("I will check.\n" + CALL)))
    assert streamed == summary(body["choices"][0])


def test_two_calls_each_choice_parsed_and_parallel_false_keeps_one(qwen3):
    body = create(qwen3, n=2, extra_body=forced(TWO_CALLS))
    for choice in body["choices"]:
        assert summary(choice) == {"content": "Checking.", "calls": [{"name": "get_weather", "arguments": ARGS},
                                                                     {"name": "noop", "arguments": "{}"}],
                                   "finish_reason": "tool_calls"}
    chunks = create(qwen3, stream=True, n=2, extra_body=forced(TWO_CALLS))
    assert assembled(chunks, 0) == assembled(chunks, 1) == summary(body["choices"][0])
    one = create(qwen3, parallel_tool_calls=False, extra_body=forced(TWO_CALLS))
    assert summary(one["choices"][0])["calls"] == [{"name": "get_weather", "arguments": ARGS}]
    one_streamed = assembled(create(qwen3, stream=True, parallel_tool_calls=False, extra_body=forced(TWO_CALLS)))
    assert one_streamed == summary(one["choices"][0])


def test_tool_choice_none_leaves_the_text_as_content(qwen3):
    body = create(qwen3, tool_choice="none", extra_body=forced(CALL))
    choice = body["choices"][0]
    assert choice["message"]["content"] == CALL and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    streamed = assembled(create(qwen3, stream=True, tool_choice="none", extra_body=forced(CALL)))
    assert streamed == {"content": CALL, "calls": [], "finish_reason": "stop"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_required_and_named_make_a_valid_call(qwen3, tool_choice):
    tools = [CLOSED, NOOP]
    body = create(qwen3, tools=tools, tool_choice=tool_choice, max_tokens=200, extra_body=NO_THINKING)
    choice = summary(body["choices"][0])
    assert choice["finish_reason"] == "tool_calls" and choice["content"] is None and choice["calls"]
    functions = {t["function"]["name"]: t["function"] for t in tools}
    for call in choice["calls"]:
        jsonschema.validate(json.loads(call["arguments"]), functions[call["name"]]["parameters"])
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in choice["calls"]] == ["get_weather"]
    streamed = assembled(create(qwen3, stream=True, tools=tools, tool_choice=tool_choice, max_tokens=200,
                                extra_body=NO_THINKING))
    assert streamed == choice


def test_tool_turns_render_with_arguments_as_objects(qwen3, tiny_family):
    from transformers import AutoTokenizer

    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
    body = create(qwen3, messages=history, max_tokens=3, extra_body={"return_token_ids": True})
    tok = AutoTokenizer.from_pretrained(str(tiny_family("qwen3")))
    as_objects = [*history[:1], {**history[1], "content": "", "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": json.loads(ARGS)}}]},
        history[2]]
    text = tok.apply_chat_template(as_objects, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert body["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    assert '"arguments": {"city": "Pa}{\\"ris", "days": 2}}' in text and "<tool_response>\n18 C" in text


def test_a_template_without_tool_support_gets_them_in_a_system_block(client, http):
    body = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2,
                                          extra_body={"return_token_ids": True}).to_dict()
    prompt = http.server.renderer.tokenizer.decode(body["prompt_token_ids"])
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                           extra_body={"return_token_ids": True}).to_dict()
    assert "# Tools" not in http.server.renderer.tokenizer.decode(plain["prompt_token_ids"])


def test_bad_tools_and_tool_choice_are_400s_naming_the_field(qwen3):
    with pytest.raises(openai.BadRequestError) as err:
        create(qwen3, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        create(qwen3, tool_choice={"type": "function", "function": {"name": "unknown"}})
    assert err.value.body["param"] == "tool_choice"


if __name__ == "__main__":
    import sys; sys.exit(pytest.main([__file__, "-q"]))
