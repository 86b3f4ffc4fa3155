"""Conversations that move (issue 17), without Ray: two in-process replicas and a real StateDepot between them.

Replica A serves two turns and leaves (ModelReplica's destructor path: Migrator.leave); replica B takes the
third turn: it computes only what the turn added, and its greedy tokens equal a cold run's (a fresh engine,
the same prompt ids). What cannot move costs recomputation only: a budget of 0, a lost depot, another
caller, another layout. tests/ray/test_migration.py runs the same through Serve's scale-in and rolling update.
"""

import asyncio

import openai
import pytest

from core.engine_config import EngineConfig
from replicas.cache.conversation_state import StateRefused
from replicas.depot import StateDepot
from replicas.engine.engine import Engine
from replicas.engine.migration import export_states, import_state
from testing.local_depot import InProcessDepot
from tests.http.conftest import MODEL
from tests.http.test_multiturn import BLOCK, turn

FIRST = "Hello! Name three rivers and say which is longest."


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def computed_by(server, fn):
    """fn() on the server's replica -> (its result, prompt tokens the engine computed meanwhile)."""
    before = server.replica.engine_stats()["num_prompt_tokens_computed"]
    result = fn()
    return result, server.replica.engine_stats()["num_prompt_tokens_computed"] - before


def two_turns(server, user: str | None = None) -> tuple[list[dict], list[dict]]:
    """Two turns on `server` -> (the messages of turn 3, the two turns' results)."""
    extra = {"user": user} if user else {}
    client, messages, results = client_of(server), [{"role": "user", "content": FIRST}], []
    for k in range(2):
        results.append(turn(client, messages, **extra))
        messages += [{"role": "assistant", "content": results[-1]["text"]},
                     {"role": "user", "content": f"Turn {k + 2}: tell me more about river {k}."}]
    return messages, results


def cold_completion(server, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
    """The greedy ids a fresh engine gives for these prompt ids (no cache can hold them there)."""
    body = client_of(server).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens,
                                                temperature=0, extra_body={"return_token_ids": True}).to_dict()
    return body["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def llama_servers(start_server):
    """Two replicas (A leaves, B takes over) and a cold one, sharing one depot."""
    a, b, cold = (start_server(own_replica=True) for _ in range(3))
    depot = InProcessDepot()
    for server in (a, b):
        server.replica.migrator.depot = depot
    return a, b, cold, depot


def leave(server) -> None:
    asyncio.run(server.replica.migrator.leave())


def test_the_next_turn_after_a_move_computes_only_what_it_added(llama_servers):
    a, b, cold, depot = llama_servers
    messages, (_, second) = two_turns(a)
    leave(a)
    assert depot.target.depot_stats()["num_states"] >= 1
    third, computed = computed_by(b, lambda: turn(client_of(b), messages))
    kept = second["prompt"] + second["completion"]
    assert third["retention"] == "retained" and third["prompt"][:len(kept)] == kept
    assert computed <= len(third["prompt"]) - len(kept) + BLOCK
    assert third["cached"] >= len(kept) // BLOCK * BLOCK - BLOCK
    assert third["completion"] == cold_completion(cold, third["prompt"])
    stats = b.replica.engine_stats()
    assert stats["num_states_imported"] >= 1 and stats["num_blocks_imported"] >= len(kept) // BLOCK - 1


def test_a_state_is_taken_by_its_own_caller_only(llama_servers):
    a, b, _, depot = llama_servers
    messages, _ = two_turns(a, user="alice")
    leave(a)
    eve = turn(client_of(b), messages, user="eve")  # the same messages, another caller (another key)
    assert eve["retention"] == "miss"
    alices = {key for key, state_id in depot.target._by_key.items()
              if depot.target._states[state_id][1].caller == "user:alice"}
    assert alices and all(depot.target.take(key, "user:eve") is None for key in alices)  # asked by key: still no
    assert depot.target.stats["num_takes_refused"] == len(alices)
    alice = turn(client_of(b), messages, user="alice")
    assert alice["retention"] == "retained"


def test_nothing_moved_costs_recomputation_only(llama_servers):
    a, b, cold, depot = llama_servers
    for lose in ("budget 0", "depot gone", "depot restarted", "taker died"):
        messages, _ = two_turns(a, user=lose)
        if lose == "budget 0":
            a.replica.migrator.config = a.replica.migrator.config.model_copy(update={"export_bytes": 0})
        leave(a)
        a.replica.migrator.config = a.replica.migrator.config.model_copy(update={"export_bytes": 1 << 30})
        depot.gone = lose == "depot gone"
        if lose == "depot restarted":
            depot.target = StateDepot()
        if lose == "taker died":  # a replica took the states and died before the turn came
            for key in list(depot.target._by_key):
                depot.target.take(key, f"user:{lose}")
        third = turn(client_of(b), messages, user=lose)
        depot.gone = False
        assert third["retention"] == "miss", lose
        assert third["completion"] == cold_completion(cold, third["prompt"]), lose


def test_an_import_into_another_model_dtype_or_layout_is_refused(llama_servers, tiny_llama_dir, tiny_hybrid_dir):
    a, _, _, _ = llama_servers
    two_turns(a, user="refusals")
    exported = asyncio.run(a.replica.engine.call(lambda e: export_states(e, 1 << 30, float("inf"))))
    state = max((s for s in exported if s.caller == "user:refusals"), key=lambda s: len(s.token_ids))
    base = dict(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    others = {"dtype": {**base, "dtype": "bfloat16"}, "model": {**base, "model": str(tiny_hybrid_dir)},
              "block_size": {**base, "block_size": 32}}
    for differs, config in others.items():
        engine = Engine(EngineConfig(**config))
        with pytest.raises(StateRefused, match=differs):
            import_state(engine, state)
        assert engine.retention.store.num_tokens == 0 and engine.block_pool.cached_hashes() == []
        assert engine.migration_stats.num_imports_refused == 1
    tampered = type(state)(**{**vars(state), "token_ids": [7] + state.token_ids[1:]})
    with pytest.raises(StateRefused, match="hashes"):
        asyncio.run(a.replica.engine.call(lambda e: import_state(e, tampered)))


def test_a_hybrid_conversation_moves_with_its_recurrent_checkpoint(start_server, tiny_hybrid_dir):
    a, b, cold = (start_server(own_replica=True, model=str(tiny_hybrid_dir)) for _ in range(3))
    depot = InProcessDepot()
    a.replica.migrator.depot = b.replica.migrator.depot = depot
    messages, (_, second) = two_turns(a)
    leave(a)
    third, computed = computed_by(b, lambda: turn(client_of(b), messages))
    kept = second["prompt"] + second["completion"]
    assert third["retention"] == "retained" and third["prompt"][:len(kept)] == kept
    # The earlier turns never run through the linear layers again: only the new ids and the last reply token.
    assert computed <= len(third["prompt"]) - len(kept) + 2
    assert third["completion"] == cold_completion(cold, third["prompt"])
    assert b.replica.engine_stats()["num_checkpoints_imported"] >= 1
