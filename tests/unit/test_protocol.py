"""Request validation: each bad value fails naming its field (the ingress turns it into a 400)."""

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from serve_app.errors import validation_error
from serve_app.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def param_of(model, body) -> str | None:
    with pytest.raises(ValidationError) as err:
        model(**body)
    wrapped = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])
    return validation_error(wrapped).param


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                         ("max_tokens", 0), ("stop", 5), ("stop", [1, 2]), ("n", 0),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0), ("min_p", 1.5), ("min_tokens", -1),
                                         ("max_completion_tokens", 0), ("top_logprobs", 21), ("best_of", 2),
                                         ("logit_bias", {"abc": 1}), ("response_format", {"type": "xml"}),
                                         ("tools", [{"type": "function"}]), ("tool_choice", "auto")])
def test_chat_bad_values_name_their_field(field, value):
    assert param_of(ChatCompletionRequest, {**CHAT, field: value}) == field


@pytest.mark.parametrize("body,field", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (default)
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # no final assistant
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content[1]"),
])
def test_cross_field_checks_name_the_field_they_blame(body, field):
    assert param_of(ChatCompletionRequest, {**CHAT, **body}) == field


def test_bad_message_names_its_path():
    assert param_of(ChatCompletionRequest, {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}) \
        == "messages.0.role"


def test_a_part_text_that_is_not_a_string_is_refused_whatever_its_type():
    """Rendering joins every part's text (fuzzing found a part of an odd type whose text was a list: a 500)."""
    for part in ({"type": "text", "text": ["a"]}, {"type": ["conversations"], "text": [{}]}, {"text": 3}):
        body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
        assert param_of(ChatCompletionRequest, body).startswith("messages.0.content"), part


def test_completion_prompt_forms():
    assert CompletionRequest(model="m", prompt="hi").prompt == "hi"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(model="m", prompt=[[4, 5]]).prompt == [4, 5]
    assert param_of(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}) == "prompt"
    assert param_of(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6}) == "logprobs"
    assert param_of(CompletionRequest, {"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}) \
        == "prompt_logprobs"


def test_sampling_params_defaults_and_max_completion_tokens():
    body = ChatCompletionRequest(**CHAT, max_completion_tokens=7, stop="###", temperature=0,
                                 logit_bias={"5": 300, "6": -2})
    params = body.sampling_params(None, None)
    assert (params.max_tokens, params.stop, params.temperature, params.top_p) == (7, ["###"], 0.0, 1.0)
    assert params.logit_bias == {5: 100.0, 6: -2.0}  # clamped to [-100, 100]
    assert ChatCompletionRequest(**CHAT).sampling_params(None, None).max_tokens is None
    assert ChatCompletionRequest(**CHAT, logprobs=True).num_logprobs() == 0
    assert ChatCompletionRequest(**CHAT, logprobs=True, top_logprobs=3).num_logprobs() == 3
    text_parts = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert text_parts.messages[0].for_template()["content"] == "a\nb"


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
