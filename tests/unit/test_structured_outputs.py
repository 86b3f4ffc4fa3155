"""response_format and structured_outputs -> the StructuredSpec on SamplingParams; bad shapes name their field."""

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from core.messages import StructuredSpec
from serve_app.errors import validation_error
from serve_app.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def spec_of(model, body) -> StructuredSpec | None:
    return model(**body).sampling_params(None, None).structured


def error_of(model, body):
    with pytest.raises(ValidationError) as err:
        model(**body)
    wrapped = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
    return validation_error(wrapped)


@pytest.mark.parametrize("body,expected", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object", param="response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json_schema", json.dumps(SCHEMA), param="response_format")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec("json_schema", json.dumps(SCHEMA),
                                                              param="structured_outputs")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredSpec("json_schema", json.dumps(SCHEMA),
                                                                          param="structured_outputs")),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object", param="structured_outputs")),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredSpec("regex", "[a-z]+", param="structured_outputs")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredSpec("choice", choices=["a", "b"],
                                                                    param="structured_outputs")),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredSpec("grammar", 'root ::= "x"',
                                                                         param="structured_outputs")),
    ({"structured_outputs": {"regex": "a", "json": None}}, StructuredSpec("regex", "a", param="structured_outputs")),
], ids=["none", "null", "text", "json_object", "json_schema", "so_json", "so_json_text", "so_json_object",
        "so_regex", "so_choice", "so_grammar", "so_null_others"])
def test_chat_fields_map_to_the_spec(body, expected):
    assert spec_of(ChatCompletionRequest, {**CHAT, **body}) == expected


def test_completions_take_structured_outputs():
    body = {"model": "m", "prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}
    assert spec_of(CompletionRequest, body) == StructuredSpec("choice", choices=["yes", "no"],
                                                              param="structured_outputs")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format", "type must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": "json"}, "response_format", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", "choice must be"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs", "JSON schema"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", "regex must be"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_bad_shapes_name_their_field(body, param, words):
    error = error_of(ChatCompletionRequest, {**CHAT, **body})
    assert error.param == param and words in error.message and error.message.startswith(param)


def test_n_choices_share_one_spec():
    body = ChatCompletionRequest(**CHAT, response_format={"type": "json_object"})
    assert body.sampling_params(None, None).structured is body.sampling_params(None, None).structured


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("spec", [
    StructuredSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    StructuredSpec("json_object"), StructuredSpec("regex", "(yes|no)"),
    StructuredSpec("choice", choices=["a.b", "c"]), StructuredSpec("grammar", 'root ::= "x" | "y"')])
def test_a_reply_that_may_reason_gets_an_optional_free_think_block_then_the_constraint(spec):
    """ThinkState.MODEL (Qwen3): one structural tag; it compiles, and holds the answer after </think>."""
    import xgrammar as xgr

    from core.reasoning import ThinkState
    from serve_app.structured import after_reasoning

    assert after_reasoning(spec, None, [7]) is spec and after_reasoning(spec, ThinkState.CLOSED, [7]) is spec
    assert after_reasoning(spec, ThinkState.OPEN, [7]).start_after == [7]
    wrapped = after_reasoning(spec, ThinkState.MODEL, [7])
    assert wrapped.kind == "structural_tag" and wrapped.start_after is None
    answer = {"json_schema": '{"a": 1}', "json_object": "{}", "regex": "yes", "choice": "a.b", "grammar": "y"}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(32, 127)])).compile_grammar(
        xgr.Grammar.from_structural_tag(wrapped.text))
    for text, is_valid in ((answer[spec.kind], True), ("<think>free text</think>\n" + answer[spec.kind], True),
                           ("<think>x</think>nonsense", False), ("nonsense", False)):
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == is_valid, text
