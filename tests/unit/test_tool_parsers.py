"""Tool-call parsers (serve_app/tools/): whole replies and streams, Hermes JSON and Qwen XML.

The stream contract: fed the reply in any pieces, the content concatenates to the non-streamed content and
the fragments to the non-streamed calls; each call's first fragment carries id, type and name, later ones
only argument text. Checked at every split point and character by character.
"""

import json

import pytest

from serve_app.tools import PARSERS, ToolCallReader

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "where": {"type": "object"},
                                     "tags": {"type": "array"}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
TOOLS = [WEATHER, NOOP]

H = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
HERMES = {  # text -> (content, [(name, arguments)])
    "plain": ("Just text.\n", ("Just text.\n", [])),
    "one": ('Let me check.\n' + H % ("get_weather", '{"city": "Paris", "days": 3}'),
            ("Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')])),
    "braces and quotes in strings": (H % ("get_weather", r'{"city": "a}{\"b\" ]} [<tool_call>", "days": 1}'),
                                     (None, [("get_weather", r'{"city": "a}{\"b\" ]} [<tool_call>", "days": 1}')])),
    "empty arguments": (H % ("noop", "{}"), (None, [("noop", "{}")])),
    "two calls": (H % ("noop", "{}") + "\n" + H % ("get_weather", '{"where": {"lat": [1, 2]}}') + "\n",
                  (None, [("noop", "{}"), ("get_weather", '{"where": {"lat": [1, 2]}}')])),
    "unicode": (H % ("get_weather", '{"city": "Zürich ☃"}'), (None, [("get_weather", '{"city": "Zürich ☃"}')])),
    "arguments first": ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
                        (None, [("get_weather", '{"city": "Oslo"}')])),
    "arguments as a string": ('<tool_call>\n{"name": "noop", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
                              (None, [("noop", '{"a": 1}')])),
    "no closing tag": ('<tool_call>\n{"name": "noop", "arguments": {}}', (None, [("noop", "{}")])),
    "compact": ('<tool_call>{"name":"noop","arguments":{"x":"}"}}</tool_call>', (None, [("noop", '{"x":"}"}')])),
    "a tag in prose": ("Write <tool_call> before a call.\n", ("Write <tool_call> before a call.\n", [])),
    "a tag with no JSON": ("<tool_call>\nnot json\n</tool_call>", ("<tool_call>\nnot json\n</tool_call>", [])),
    "an object that is no call": ('<tool_call>\n{"city": "x"}\n</tool_call>',
                                  ('<tool_call>\n{"city": "x"}\n</tool_call>', [])),
    "prose then a call": ("Use <tool_call> tags. " + H % ("noop", "{}"), ("Use <tool_call> tags.", [("noop", "{}")])),
    "text between calls": (H % ("noop", "{}") + "\nand then\n" + H % ("noop", '{"b": 2}'),
                           ("\nand then", [("noop", "{}"), ("noop", '{"b": 2}')])),
    "a lone '<'": ("a < b <tool and <tool_cal\n", ("a < b <tool and <tool_cal\n", [])),
}

X = "<tool_call>\n<function=%s>\n%s</function>\n</tool_call>"
P = "<parameter=%s>\n%s\n</parameter>\n"
QWEN3_XML = {
    "plain": ("No call here.", ("No call here.", [])),
    "one, typed by the schema": (
        "Checking.\n\n" + X % ("get_weather", P % ("city", "Paris") + P % ("days", "3") + P % ("metric", "True")),
        ("Checking.", [("get_weather", '{"city": "Paris", "days": 3, "metric": true}')])),
    "multi-line text and JSON values": (
        X % ("get_weather", P % ("city", 'two\nlines {"x"} </param') + P % ("where", '{"lat": [1, 2]}')
             + P % ("tags", '["a", "b"]')),
        (None, [("get_weather", '{"city": "two\\nlines {\\"x\\"} </param", "where": {"lat": [1, 2]}, '
                                '"tags": ["a", "b"]}')])),
    "no parameters": (X % ("noop", ""), (None, [("noop", "{}")])),
    "unknown parameter stays text": (X % ("noop", P % ("n", "5")), (None, [("noop", '{"n": "5"}')])),
    "two calls": (X % ("noop", "") + "\n" + X % ("get_weather", P % ("city", "Rome")),
                  (None, [("noop", "{}"), ("get_weather", '{"city": "Rome"}')])),
    "no newlines": ("<tool_call><function=noop><parameter=a>x</parameter></function></tool_call>",
                    (None, [("noop", '{"a": "x"}')])),
    "a tag in prose": ("The <tool_call> tag wraps calls.", ("The <tool_call> tag wraps calls.", [])),
    "a function tag that never closes": ("<tool_call>\n<function=noop\nx", ("<tool_call>\n<function=noop\nx", [])),
}
CASES = [("hermes", k, *v) for k, v in HERMES.items()] + [("qwen3_xml", k, *v) for k, v in QWEN3_XML.items()]


def streamed(parser: str, pieces: list[str], tools=TOOLS, parallel=True) -> tuple[str, list[dict]]:
    """Feeds the pieces; checks each fragment's shape; -> (content, calls assembled by index)."""
    stream = ToolCallReader(parser, tools, parallel).stream()
    content, calls = "", {}
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += out.content
        for fragment in out.tool_calls:
            index, function = fragment["index"], fragment["function"]
            if index not in calls:
                assert fragment["id"].startswith("call_") and fragment["type"] == "function" and function["name"]
                calls[index] = {"name": function["name"], "arguments": ""}
            else:
                assert set(fragment) == {"index", "function"} and set(function) == {"arguments"}
            calls[index]["arguments"] += function.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def as_pairs(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) if "function" in c else (c["name"], c["arguments"])
            for c in calls]


@pytest.mark.parametrize("parser,case,text,expected", CASES, ids=[f"{p}-{c}" for p, c, *_ in CASES])
def test_parse(parser, case, text, expected):
    content, calls = ToolCallReader(parser, TOOLS).parse(text)
    assert (content, as_pairs(calls)) == expected
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("parser,case,text,expected", CASES, ids=[f"{p}-{c}" for p, c, *_ in CASES])
def test_stream_equals_parse_at_every_split(parser, case, text, expected):
    content, calls = expected
    for i in range(len(text) + 1):
        got_content, got_calls = streamed(parser, [text[:i], text[i:]])
        assert (got_content or None if calls else got_content, as_pairs(got_calls)) == (content, calls), i
    got_content, got_calls = streamed(parser, list(text))
    assert (got_content or None if calls else got_content, as_pairs(got_calls)) == (content, calls)


def test_first_fragment_carries_id_and_name_before_any_argument_text():
    stream = ToolCallReader("hermes", TOOLS).stream()
    outs = [stream.feed(ch) for ch in H % ("get_weather", '{"city": "Paris"}')]
    fragments = [f for out in outs for f in out.tool_calls]
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["id"]
    assert fragments[0]["function"]["arguments"] == "{"  # the header resolves at the arguments' '{'
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    assert len(fragments) > 10  # the arguments streamed as they came, not at the end


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml"])
def test_parallel_false_keeps_the_first_call_only(parser):
    text = HERMES["two calls"][0] if parser == "hermes" else QWEN3_XML["two calls"][0]
    content, calls = ToolCallReader(parser, TOOLS, parallel_tool_calls=False).parse(text)
    assert content is None and as_pairs(calls) == [("noop", "{}")]
    for pieces in ([text], list(text)):
        assert as_pairs(streamed(parser, pieces, parallel=False)[1]) == [("noop", "{}")]


def test_a_call_cut_short_is_content_when_not_streamed():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert ToolCallReader("hermes", TOOLS).parse(text) == (text, [])
    # The stream committed at the header and sent what came: a cut call stays cut (finish_reason says "length").
    assert streamed("hermes", [text]) == ("Sure.", [{"name": "get_weather", "arguments": '{"city": "Par'}])


def test_finish_reason():
    assert ToolCallReader.finish_reason("stop", True) == "tool_calls"
    assert ToolCallReader.finish_reason("length", True) == "length"
    assert ToolCallReader.finish_reason("stop", False) == "stop"


def test_every_parser_is_tested():
    assert {p for p, *_ in CASES} == set(PARSERS)


if __name__ == "__main__":
    import sys; sys.exit(pytest.main([__file__, "-q"]))
