"""serve_app/tools/grammar.py: the structural tag for tool_choice "required" / named, compiled by xgrammar,
accepts exactly the calls the parser of the same format reads, with arguments valid for the tool's schema."""

import json

import jsonschema
import pytest

from serve_app.tools import ToolCallReader, tool_call_structural_tag

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
TOOLS = [WEATHER, NOOP]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

CALLS = {  # parser -> (a weather call, a noop call, a weather call missing its required city)
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "c"}}'
               '\n</tool_call>',
               '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>'),
    "qwen3_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=noop>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                  "</tool_call>"),
}


def grammar(parser: str, choice, parallel: bool = True):
    return xgr.Grammar.from_structural_tag(json.dumps(tool_call_structural_tag(TOOLS, choice, parser, parallel)))


@pytest.mark.parametrize("parser", CALLS)
def test_required_accepts_one_or_more_valid_calls_and_nothing_else(parser):
    weather, noop, missing = CALLS[parser]
    required = grammar(parser, "required")
    assert accepts(required, weather) and accepts(required, noop) and accepts(required, weather + "\n" + noop)
    assert not accepts(required, "") and not accepts(required, missing) and not accepts(required, "Hi " + noop)
    single = grammar(parser, "required", parallel=False)
    assert accepts(single, weather) and not accepts(single, weather + "\n" + noop)


@pytest.mark.parametrize("parser", CALLS)
def test_named_accepts_that_function_only(parser):
    weather, noop, missing = CALLS[parser]
    named = grammar(parser, NAMED)
    assert accepts(named, weather)
    assert not accepts(named, noop) and not accepts(named, missing) and not accepts(named, weather + "\n" + weather)


@pytest.mark.parametrize("parser", CALLS)
def test_what_the_grammar_accepts_the_parser_reads(parser):
    weather, noop, _ = CALLS[parser]
    content, calls = ToolCallReader(parser, TOOLS).parse(weather + "\n" + noop)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments == {"city": "Paris", "days": 3, "unit": "c"}


@pytest.mark.parametrize("parser", CALLS)
def test_optional_reasoning_allows_one_think_block_before_the_calls(parser):
    weather, noop, _ = CALLS[parser]
    tag = tool_call_structural_tag(TOOLS, "required", parser, optional_reasoning=True)
    both = xgr.Grammar.from_structural_tag(json.dumps(tag))
    assert accepts(both, noop) and accepts(both, "<think>\nNo {call} <tool_call> here.\n</think>\n\n" + weather)
    assert not accepts(both, "<think>x</think>") and not accepts(both, "Hi " + noop)


def test_auto_and_none_need_no_grammar():
    assert tool_call_structural_tag(TOOLS, "auto", "hermes") is None
    assert tool_call_structural_tag(TOOLS, "none", "hermes") is None
    assert tool_call_structural_tag(None, None, "hermes") is None


def test_the_hermes_tag_begins_as_the_templates_write_a_call():
    tag = tool_call_structural_tag([{"type": "function", "function": {"name": "a.b-c"}}],
                                   {"type": "function", "function": {"name": "a.b-c"}}, "hermes")
    assert tag["format"]["begin"] == '<tool_call>\n{"name": "a.b-c", "arguments": '


if __name__ == "__main__":
    import sys; sys.exit(pytest.main([__file__, "-q"]))
