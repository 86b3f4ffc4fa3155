"""Structured outputs end to end through the official openai client.

On SmolLM2 (real weights: it writes sensible JSON and finishes): `parse` with a pydantic model (nested
objects, arrays, enums, an optional field) returns the parsed object and the raw text validates with
jsonschema; json_object; structured_outputs regex and choice; streamed and not; n = 3; min_tokens, max_tokens
and a stop string with a grammar; completions. On the tiny model: the errors, as 400s naming the field.
"""

import json
import re
from enum import Enum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tests.http.conftest import MODEL

pytestmark = pytest.mark.slow  # SmolLM2 decodes ~1000 tokens here (~15 s on 2 cores)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    species: Literal["cat", "dog", "fish"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    pets: list[Pet] = Field(max_length=2)
    nickname: str | None = Field(default=None, max_length=12)


PERSON_SCHEMA = to_strict_json_schema(Person)  # what `parse` sends: every field required, nothing extra
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON_SCHEMA, "strict": True}}
ALICE = [{"role": "user", "content": "Describe Alice, 30, who owns a cat named Tom, as JSON."}]


@pytest.fixture(scope="module")
def smol(smollm2_dir, start_server) -> openai.OpenAI:
    server = start_server(own_replica=True, model=str(smollm2_dir))
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, messages=ALICE, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def streamed(client, **kwargs) -> tuple[dict[int, str], dict[int, str]]:
    """Text and finish reason per choice index, joined from the SSE chunks."""
    texts, reasons = {}, {}
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_parse_returns_the_pydantic_object(smol):
    completion = smol.chat.completions.parse(model=MODEL, messages=ALICE, response_format=Person, temperature=0,
                                             max_tokens=150)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person) and choice.message.parsed.pets
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_json_schema_streamed_equals_the_body(smol):
    body = chat(smol, response_format=PERSON_FORMAT, temperature=0, max_tokens=150).choices[0].message.content
    texts, reasons = streamed(smol, response_format=PERSON_FORMAT, temperature=0, max_tokens=150)
    assert texts[0] == body and reasons[0] == "stop"
    jsonschema.validate(json.loads(body), PERSON_SCHEMA)


def test_n_3_gives_3_valid_objects(smol):
    completion = chat(smol, response_format=PERSON_FORMAT, n=3, temperature=0.8, seed=1, max_tokens=150)
    assert [c.finish_reason for c in completion.choices] == ["stop"] * 3
    for choice in completion.choices:
        Person.model_validate_json(choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_json_object_is_an_object(smol):
    messages = [{"role": "user", "content": "Return a JSON object with the keys city and country for Paris."}]
    for stream in (False, True):
        if stream:
            texts, reasons = streamed(smol, messages=messages, response_format={"type": "json_object"},
                                      temperature=0, max_tokens=60)
            text, reason = texts[0], reasons[0]
        else:
            choice = chat(smol, messages=messages, response_format={"type": "json_object"}, temperature=0,
                          max_tokens=60).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert reason == "stop" and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_structured_outputs_regex_and_choice_hold(smol, stream):
    phone = [{"role": "user", "content": "Make up a phone number."}]
    review = [{"role": "user", "content": "Is this review positive or negative? 'I loved it.'"}]
    cases = [(phone, {"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
             (review, {"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative"))]
    for messages, extra, holds in cases:
        kwargs = dict(messages=messages, temperature=0, max_tokens=20, extra_body={"structured_outputs": extra})
        if stream:
            texts, reasons = streamed(smol, **kwargs)
            text, reason = texts[0], reasons[0]
        else:
            choice = chat(smol, **kwargs).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert reason == "stop" and holds(text), text


def test_min_tokens_with_a_grammar_ends_where_the_grammar_does(smol):
    review = [{"role": "user", "content": "Is this review positive or negative? 'I loved it.'"}]
    choice = chat(smol, messages=review, temperature=0, max_tokens=20,
                  extra_body={"structured_outputs": {"choice": ["positive", "negative"]}, "min_tokens": 10}).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in ("positive", "negative")


def test_max_tokens_cuts_json_short_and_a_stop_string_applies(smol):
    full = chat(smol, response_format=PERSON_FORMAT, temperature=0, max_tokens=150).choices[0].message.content
    cut = chat(smol, response_format=PERSON_FORMAT, temperature=0, max_tokens=6).choices[0]
    assert cut.finish_reason == "length" and full.startswith(cut.message.content) and cut.message.content != full
    with pytest.raises(ValueError):
        json.loads(cut.message.content)
    stopped = chat(smol, response_format=PERSON_FORMAT, temperature=0, max_tokens=150, stop=['"age"']).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == full[:full.index('"age"')]


def test_completions_take_structured_outputs(smol):
    completion = smol.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                         temperature=0, extra_body={"structured_outputs": {"choice": [" Paris",
                                                                                                      " Rome"]}})
    assert completion.choices[0].text in (" Paris", " Rome") and completion.choices[0].finish_reason == "stop"


# -- errors, on the tiny model ------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be one of"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
], ids=["bad_schema", "no_schema", "bad_type", "bad_regex", "bad_ebnf", "two_kinds", "no_choice", "both"])
@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_errors_answer_400_naming_the_field(http, body, param, words, stream):
    with httpx.Client(base_url=http.base_url, timeout=60) as raw:
        response = raw.post("/v1/chat/completions", json={**CHAT, **body, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and words in error["message"]
    assert "/project/" not in error["message"]


def test_one_bad_spec_does_not_disturb_the_others(client):
    """A valid structured request right after an invalid one, and a plain one: both served."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "(("}})
    ok = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", ok.choices[0].message.content)
    assert client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4).usage \
        .completion_tokens == 4


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
