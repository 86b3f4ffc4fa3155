"""Properties of the protocol layer (serve_app/protocol.py, errors.py) against the served schema (openapi.py).

1. Any JSON object sent to a route is accepted or refused with a 400 that names a field.
2. Any JSON the served schema allows is accepted and renders (sampling params, template messages, and the
   chat template's prompt ids), or fails a cross-field check JSON Schema cannot state: a 400 naming a field.
"""

import jsonschema
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.messages import RequestError
from serve_app.errors import validation_error
from serve_app.openapi import Deployment, refine_requests
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

DEPLOYMENT = Deployment("tiny", vocab_size=49152, max_n=16, max_model_len=2048, takes_images=False, has_auth=False)
MODELS = {m.__name__: m for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)}
# Cross-field checks (protocol.py's FieldError) and the few the schema states as a subset.
CROSS_FIELD = {"min_tokens", "continue_final_message", "top_logprobs", "tool_choice", "prompt_logprobs"}
PROPERTY_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))


def served_components() -> dict:
    components = {}
    for name, model in MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    refine_requests(components, DEPLOYMENT)
    return components


COMPONENTS = served_components()


def allows(name: str, body) -> bool:
    root = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": COMPONENTS}}
    return jsonschema.Draft202012Validator(root).is_valid(body)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 50), st.floats(-3, 3, allow_nan=False),
                      st.sampled_from(["", "tiny", "hi", "auto", "text", "user", "assistant", "0", "12"]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["type", "text", "role", "content", "json",
                                                                   "choice", "name", "0", "7"]), inner,
                                                 max_size=3)), max_leaves=6)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
                                optional={"content": st.one_of(st.text(max_size=20), st.none(), st.lists(
                                    st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]),
                                                           "text": st.text(max_size=10)}), max_size=2))})


def bodies(name: str):
    """JSON objects over the model's own field names: plausible values, often valid, often not."""
    fields = list(MODELS[name].model_fields)
    special = {"model": st.sampled_from(["tiny", "other", None]), "messages": st.lists(message, max_size=3),
               "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 60000), max_size=4)),
               "tokens": st.lists(st.integers(-1, 60000), max_size=4)}
    return st.dictionaries(st.sampled_from(fields), json_value, max_size=6).flatmap(
        lambda base: st.fixed_dictionaries({k: special[k] for k in special if k in fields}).map(
            lambda extra: {**extra, **base} if base.get("model") else {**base, **extra}))


def refusal(name: str, body) -> RequestError | None:
    """None when the model accepts the body, else the 400 the ingress would answer."""
    try:
        MODELS[name].model_validate(body)
    except ValidationError as exc:
        return validation_error(RequestValidationError(exc.errors()))
    return None


@pytest.mark.parametrize("name", list(MODELS))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_any_object_is_accepted_or_a_400_naming_a_field(name, data):
    body = data.draw(bodies(name))
    error = refusal(name, body)
    if error is not None:
        assert error.status_code == 400
        assert error.param and error.param.split(".")[0].split("[")[0] in MODELS[name].model_fields, error.param


@pytest.fixture(scope="module")
def renderer(tiny_llama_dir):
    from serve_app.render import Renderer

    return Renderer(str(tiny_llama_dir))


@pytest.mark.parametrize("name", ["ChatCompletionRequest", "CompletionRequest"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_what_the_schema_allows_renders(name, data, renderer):
    body = data.draw(bodies(name).filter(lambda b: allows(name, b)))
    error = refusal(name, body)
    if error is not None:  # only a check JSON Schema cannot state
        assert error.param in CROSS_FIELD, (body, error.message)
        return
    request = MODELS[name].model_validate(body)
    if name == "ChatCompletionRequest":
        params = request.sampling_params(request.num_logprobs(), None)
        messages = [m.for_template() for m in request.messages]
        try:
            assert renderer.render_chat(messages, request.add_generation_prompt, request.chat_template_kwargs)
        except RequestError as exc:  # the template's own checks: a 400 naming messages
            assert exc.status_code == 400 and exc.param == "messages"
    else:
        params = request.sampling_params(request.logprobs, request.prompt_logprobs_needed())
        try:
            assert renderer.encode_prompt(request.prompt)
        except RequestError as exc:  # text the tokenizer drops whole ("\x16"): a 400 naming prompt
            assert exc.status_code == 400 and exc.param == "prompt"
    assert params.max_tokens is None or 1 <= params.max_tokens < DEPLOYMENT.max_model_len


def test_the_schema_names_the_served_model():
    assert allows("CompletionRequest", {"model": "tiny", "prompt": "hi"})
    assert not allows("CompletionRequest", {"model": "other", "prompt": "hi"})
    assert not allows("ChatCompletionRequest", {"model": "tiny", "messages": [{"role": "user"}], "stop": ""})
    assert not allows("ChatCompletionRequest", {"model": "tiny", "messages": [{"role": "user"}], "n": 17})
