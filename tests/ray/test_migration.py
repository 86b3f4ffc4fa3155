"""Conversations survive a replica's removal (issue 17), through Serve itself.

An app deployed as `serve deploy` deploys it (the controller's apply_config with a ServeDeploySchema, the
REST API's path), beside the session's app: 8 conversations x 3 turns on 3 replicas; then the same config
with `deployments: [{name: ModelReplica, num_replicas: 2}]`, so Serve removes one replica, which exports
its conversations to the StateDepot as it leaves; the router chooses among the survivors. The 4th turn of
every conversation computes at most its new tokens + one block (the survivors' own counters agree with
usage), and its greedy tokens equal a cold engine's for the same ids. The hybrid model: the earlier turns
never run through the linear layers again. Then a rolling update (a ray_actor_options change restarts every
replica) under a light load: no request fails, and every conversation keeps its computed prefix.
"""

import pytest

from serve_app.local_server import free_port
from testing.migration import (APP, BLOCK, NUM_CONVERSATIONS, ROLLED_OPTIONS, app_config, deploy, light_load,
                               new_tokens, next_turn, start_with_conversations, wait_for)
from tests.ray.conftest import stats_of_each

PORT = free_port()


def replica_stats(ids: set[str]) -> dict[str, dict]:
    return stats_of_each(ids, APP)


def cold_completion(model_dir, prompt: list[int]) -> list[int]:
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine
    from tests.engine.conftest import greedy, run_all

    return run_all(Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256)),
                   [greedy("cold", prompt, max_tokens=8)])["cold"]


@pytest.fixture
def conversations_on_three(serve_app):
    """model_dir -> the app's URL (the fast path: its Ingress answers HTTP itself), 8 conversations of 3 turns
    spread over its 3 replicas, their ids."""
    from ray import serve

    yield lambda model_dir: start_with_conversations(app_config(model_dir, PORT), NUM_CONVERSATIONS, turns=3)
    serve.delete(APP)


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_scale_in_moves_every_conversation_to_a_survivor(conversations_on_three, model, tiny_llama_dir,
                                                         tiny_hybrid_dir):
    model_dir = tiny_llama_dir if model == "llama" else tiny_hybrid_dir
    base, conversations, before = conversations_on_three(model_dir)
    held = {c["turns"][-1]["replica"] for c in conversations}
    deploy(app_config(model_dir, PORT, [{"name": "ModelReplica", "num_replicas": 2}]))
    survivors = wait_for(2)
    [victim] = before - survivors
    assert victim in held, "no conversation lived on the removed replica: nothing would move"
    start = replica_stats(survivors)
    for conversation in conversations:
        result = next_turn(base, conversation)
        assert result["replica"] in survivors
        computed = len(result["prompt"]) - result["cached"]
        # Hybrid: the new ids and the last reply token only; the linear layers never see the history again.
        assert computed <= new_tokens(conversation) + (2 if model == "hybrid" else BLOCK), conversation["turns"]
        assert result["retention"] == "retained"
        assert result["completion"] == cold_completion(model_dir, result["prompt"])
    end = replica_stats(survivors)
    computed = sum(end[r]["num_prompt_tokens_computed"] - start[r]["num_prompt_tokens_computed"] for r in survivors)
    assert computed == sum(len(c["turns"][-1]["prompt"]) - c["turns"][-1]["cached"] for c in conversations)
    assert sum(end[r]["num_states_imported"] for r in survivors) >= sum(
        c["turns"][-2]["replica"] == victim for c in conversations)
    if model == "llama":
        rolling_update_keeps_every_prefix(base, conversations, model_dir, survivors)


def rolling_update_keeps_every_prefix(base: str, conversations: list[dict], model_dir, old: set[str]) -> None:
    """A ray_actor_options change restarts every replica, one by one, while a client keeps chatting."""
    with light_load(base, conversations[:4]) as (failures, _):
        deploy(app_config(model_dir, PORT, [{"name": "ModelReplica", "num_replicas": 2,
                                             "ray_actor_options": ROLLED_OPTIONS}]))
        wait_for(2, gone=old)
    assert failures == []
    for conversation in conversations:
        result = next_turn(base, conversation)
        assert result["retention"] == "retained", conversation["turns"]
        assert len(result["prompt"]) - result["cached"] <= new_tokens(conversation) + BLOCK
