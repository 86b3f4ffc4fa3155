"""Tools into the prompt (serve_app/tools/prompt.py, serve_app/render.py), the parser a template gets
(core/tool_calls/reader.py), and `tools` / `tool_choice` validation (serve_app/tools/validation.py)."""

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from serve_app.errors import validation_error
from serve_app.protocol import ChatCompletionRequest
from serve_app.tools import choose_parser, hermes_messages
from testing.family_tokenizers import make_family_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=fields.pop("messages", TURNS), **fields)


@pytest.fixture(scope="module")
def renderer(smollm2_dir, tmp_path_factory):
    from serve_app.render import Renderer

    made = {}

    def get(family: str | None) -> Renderer:
        if family not in made:
            path = smollm2_dir if family is None else \
                make_family_tokenizer(family, smollm2_dir, tmp_path_factory.mktemp(family))
            made[family] = Renderer(str(path))
        return made[family]

    return get


def test_arguments_reach_the_template_as_an_object_and_key_retention_canonically():
    message = chat().messages[1].for_template()
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    spaced = {**CALL, "function": {**CALL["function"], "arguments": '{ "city" : "Paris" }'}}
    respaced = chat(messages=[TURNS[0], {**TURNS[1], "tool_calls": [spaced]}]).messages[1].for_template()
    assert respaced == message  # so history_key matches whatever spacing the client re-serialises with


@pytest.mark.parametrize("parser,reply", [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'),
    ("qwen3_xml", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "</function>\n</tool_call>")])
def test_a_parsed_reply_and_the_clients_echo_of_it_key_alike(parser, reply):
    """What retention needs from the replica: the reply it parsed, canonical, is the message the client sends
    back (with its own spacing, null content, the call's id), canonical (core.hashing)."""
    from core.hashing import canonical_message
    from serve_app.tools import ToolCallReader

    content, calls = ToolCallReader(parser, [TOOL]).parse(reply)
    server = canonical_message({"role": "assistant", "content": content, "tool_calls": calls})
    echo = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris"}, indent=2)}}]}
    assert canonical_message(chat(messages=[TURNS[0], echo]).messages[1].for_template()) == server


@pytest.mark.parametrize("family", [None, "qwen2", "qwen3", "qwen3_5", "llama3"])
def test_a_tool_turn_finds_its_new_messages_span(renderer, family):
    r = renderer(family)
    messages = [m.for_template() for m in chat().messages]
    render = r.render_turn(messages, True, None, "", "m", True, tools=[TOOL])
    start, end = render.new_turn_span
    assert render.retention == "span" and "18 C" in r.tokenizer.decode(render.prompt_token_ids[start:end])
    assert "get_weather" not in r.tokenizer.decode(render.prompt_token_ids[start:end])


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_5"])
def test_tool_turns_render_through_the_family_template(renderer, family):
    r = renderer(family)
    assert r.supports_tools
    text = r.render_text([m.for_template() for m in chat().messages], tools=[TOOL])
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert "<tool_response>\n18 C\n</tool_response>" in text
    if family == "qwen3_5":
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    else:  # an object, not the JSON string quoted again
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_a_template_without_tool_support_gets_the_hermes_block(renderer):
    r = renderer(None)  # SmolLM2's template ignores tools
    assert not r.supports_tools
    text = r.render_text([m.for_template() for m in chat().messages], tools=[TOOL])
    system = text.split("<|im_end|>")[0]
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in system and "<tool_call></tool_call>" in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    plain = r.render_text([TURNS[0]])
    assert "# Tools" not in plain and plain == r.tokenizer.apply_chat_template([TURNS[0]], tokenize=False,
                                                                               add_generation_prompt=True)


def test_hermes_messages_merge_tool_results_for_strict_templates():
    messages = [{"role": "system", "content": "Be brief."}, *TURNS[:2],
                {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "user", "content": "ok?"}]
    out = hermes_messages([m if m["role"] != "assistant" else chat().messages[1].for_template() for m in messages],
                          [TOOL])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[3]["content"] == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>\nok?"


@pytest.mark.parametrize("family,parser", [(None, "hermes"), ("qwen2", "hermes"), ("qwen3", "hermes"),
                                           ("qwen3_5", "qwen3_xml"), ("llama3", "hermes")])
def test_auto_picks_the_parser_from_the_template(renderer, family, parser):
    r = renderer(family)
    assert choose_parser("auto", r.tokenizer.chat_template, r.supports_tools) == parser
    assert choose_parser("qwen3_xml", r.tokenizer.chat_template, r.supports_tools) == "qwen3_xml"


def param_of(**fields) -> str:
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    wrapped = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
    return validation_error(wrapped)


@pytest.mark.parametrize("tools,words", [
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([TOOL, TOOL], "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
     "not a valid JSON schema"),
])
def test_bad_tools_are_400s_naming_tools(tools, words):
    error = param_of(tools=tools)
    assert error.param == "tools" and words in str(error)


@pytest.mark.parametrize("fields,words", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "auto"}, "needs tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "must be"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not in tools"),
])
def test_bad_tool_choice_is_a_400_naming_tool_choice(fields, words):
    error = param_of(**fields)
    assert error.param == "tool_choice" and words in str(error)


def test_good_tool_requests_validate():
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert chat(tools=[TOOL], tool_choice=choice, parallel_tool_calls=False).tools == [TOOL]
    assert chat(tool_choice="none").tools is None
    assert chat(tools=[{"type": "function", "function": {"name": "no_parameters"}}]).tools


if __name__ == "__main__":
    import sys; sys.exit(pytest.main([__file__, "-q"]))
