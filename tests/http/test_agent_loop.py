"""An agent loop over HTTP: assistant tool call -> tool result -> ..., six turns, on a tiny Qwen3 with its
published template and on SmolLM2 (`make serve`'s model, whose template has no tool support: the tools and
tool turns go in Hermes form, serve_app/tools/prompt.py). The calls are the model's own (tool_choice "required": the grammar holds the format,
the model picks the arguments). From turn 2 each turn computes at most its new tokens and one block and says
"retained": the replica keyed the finished turn by the calls it parsed out of it (replicas/engine/retention.py),
as the client got them back; a client that re-serialises the arguments with other spacing still matches, an
edited argument does not (and the turn says so)."""

import json

import openai
import pytest

from tests.http.conftest import MODEL
from tests.http.test_tools import CLOSED, NO_THINKING

BLOCK = 16  # the engine's default block size
NUM_TURNS = 6


@pytest.fixture(scope="module", params=["qwen3", "smollm2"])
def agent(request, tiny_family, smollm2_dir, start_server):
    model = smollm2_dir if request.param == "smollm2" else tiny_family("qwen3")
    server = start_server(own_replica=True, model=str(model))
    return server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def step(server, client, messages: list[dict]) -> dict:
    before = server.replica.engine_stats()["num_prompt_tokens_computed"]
    body = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CLOSED], tool_choice="required", temperature=0, max_tokens=60,
        parallel_tool_calls=False,  # one call per turn: SmolLM2 would go on calling until max_tokens
        extra_body={"return_token_ids": True, **NO_THINKING}).to_dict()
    computed = server.replica.engine_stats()["num_prompt_tokens_computed"] - before
    choice, details = body["choices"][0], body["usage"]["prompt_tokens_details"]
    assert choice["finish_reason"] == "tool_calls", choice
    return {"message": choice["message"], "prompt": body["prompt_token_ids"], "completion": choice["token_ids"],
            "computed": computed, "retention": details["retention"], "retained": details["retained_tokens"]}


def loop(server, client, reserialise=lambda arguments: arguments) -> list[dict]:
    messages, turns = [{"role": "user", "content": "Plan a trip: check the weather, one city at a time."}], []
    for k in range(NUM_TURNS):
        turn = step(server, client, messages)
        turns.append(turn)
        calls = [{**call, "function": {**call["function"],
                                       "arguments": reserialise(call["function"]["arguments"])}}
                 for call in turn["message"]["tool_calls"]]
        messages.append({"role": "assistant", "content": turn["message"]["content"], "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {20 + k} C"}
                     for call in calls]
    return turns


def check_retained(turns: list[dict]) -> None:
    assert turns[0]["retention"] == "first turn"
    for prev, cur in zip(turns, turns[1:]):
        kept = prev["prompt"] + prev["completion"]
        assert cur["retention"] == "retained", cur["retention"]
        assert cur["prompt"][:len(kept)] == kept  # the model's own ids for its call, then the new messages
        assert cur["computed"] <= len(cur["prompt"]) - len(kept) + BLOCK


def test_six_tool_turns_each_cost_only_what_they_added(agent):
    check_retained(loop(*agent))


def test_arguments_re_serialised_by_the_client_still_retain(agent):
    check_retained(loop(*agent, reserialise=lambda arguments: json.dumps(json.loads(arguments), indent=2)))


def test_an_edited_argument_falls_back_and_says_why(agent):
    server, client = agent
    messages = [{"role": "user", "content": "Plan a trip: check the weather, one city at a time."}]
    first = step(server, client, messages)
    call = first["message"]["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    arguments["city"] = "Oslo" if arguments["city"] != "Oslo" else "Paris"  # the client changed what was said
    edited = {**call, "function": {**call["function"], "arguments": json.dumps(arguments)}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [edited]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    second = step(server, client, messages)
    assert second["retention"] == "miss"  # no turn the model produced has this history: the render is used
    assert second["retained"] == 0
