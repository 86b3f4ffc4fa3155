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
                                         ("presence_penalty", 0.5), ("max_completion_tokens", 0),
                                         ("logprobs", True)])
def test_chat_bad_values_name_their_field(field, value):
    assert param_of(ChatCompletionRequest, {**CHAT, field: value}) == field


def test_bad_message_names_its_path():
    assert param_of(ChatCompletionRequest, {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}) \
        == "messages.0.role"


def test_completion_prompt_forms():
    assert CompletionRequest(model="m", prompt="hi").prompt == "hi"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(model="m", prompt=[[4, 5]]).prompt == [4, 5]
    assert param_of(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}) == "prompt"
    assert param_of(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}) == "echo"


def test_sampling_params_defaults_and_max_completion_tokens():
    body = ChatCompletionRequest(**CHAT, max_completion_tokens=7, stop="###", temperature=0)
    params = body.sampling_params()
    assert (params.max_tokens, params.stop, params.temperature, params.top_p) == (7, ["###"], 0.0, 1.0)
    assert ChatCompletionRequest(**CHAT).sampling_params().max_tokens is None


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
