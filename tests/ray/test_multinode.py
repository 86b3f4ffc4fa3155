"""Tether across Ray nodes (issue 28), on one machine: worker nodes joined to the session's Ray
(testing/local_nodes.py: their own raylets, object stores and workers, as `ray start --address` on other hosts).

An app deployed as `serve deploy` deploys it: 2 ModelReplicas, each needing the custom resource `tether-slot`
that only the worker nodes offer (one each on nodes A and B), its Ingress and its StateDepot on the head
(`tether-head`). In order, on one app:
1. conversations keep their replica, on their node, turn after turn; a request's n choices span both nodes once
   the one replica's slots are full (max_num_seqs 2);
2. node B dies mid-stream: the stream ends with an error event, requests meanwhile answer 200 or a 503 with
   Retry-After, nothing else; every conversation's next turn is the cold engine's answer, on node A;
3. node C joins (two slots): Serve starts the missing replica there; new conversations land on it, and no live
   conversation moves to it, also those whose rendezvous owner it now is;
4. node A is drained (a preemption notice): Serve starts its replica again on C and stops the old one, which
   exports its conversations to the depot; their next turns, on node C, compute at most the new tokens + one
   block and equal the cold engine's.
"""

import json
import time

import httpx
import pytest

from core.hashing import rendezvous_owner, route_key
from serve_app.local_server import free_port
from serve_app.routes import REPLICA_HEADER
from testing.local_nodes import add_node, drain_node, kill_node, stop_node
from testing.migration import BLOCK, MODEL, deploy, new_tokens, next_turn, spread_over, wait_for
from testing.routing_warmup import wait_until_routed_to_each
from tests.ray.conftest import HEAD_RESOURCE, stats_of_each
from tests.ray.test_migration import cold_completion

APP = "multinode"
SLOT = "tether-slot"  # a replica slot: only worker nodes offer it
PORT = free_port()


def app_config(model_dir) -> dict:
    head = {HEAD_RESOURCE: 1}
    return {"name": APP, "route_prefix": f"/{APP}", "import_path": "serve_app.app:build_app",
            "args": {"model": str(model_dir), "served_model_name": MODEL, "num_replicas": 2, "dtype": "float32",
                     "replica_num_cpus": 0, "replica_resources": {SLOT: 1},
                     "engine": {"num_threads": 1, "max_num_seqs": 2}, "ingress": {"http_port": PORT},
                     "migration": {"depot_resources": head, "depot_bytes": 256 << 20}},
            "deployments": [{"name": "Ingress", "ray_actor_options": {"num_cpus": 0, "resources": head}}]}


def replica_nodes(count: int, gone: set[str] = frozenset()) -> dict[str, str]:
    """Once the app runs `count` ModelReplicas, none of `gone`: replica id -> the node id it runs on."""
    ids = wait_for(count, gone, app=APP)
    return {rid: stats["node_id"] for rid, stats in stats_of_each(ids, APP).items()}


def first_turns_owned_by(owner: str, replica_ids: list[str], count: int, label: str) -> list[dict]:
    """`count` new conversations whose rendezvous owner among `replica_ids` is `owner`."""
    conversations, i = [], 0
    while len(conversations) < count:
        messages = [{"role": "user", "content": f"{label} {i}: name three lakes."}]
        if rendezvous_owner(route_key("", MODEL, messages=messages), replica_ids) == owner:
            conversations.append({"messages": messages, "turns": []})
        i += 1
    return conversations


def stream_events(body: dict, after_events: int, then) -> tuple[str, list[str]]:
    """Streams `body`; after `after_events` lines runs `then()` -> (the replica, every `data:` event)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(after_events)]
            then()
            events = [line.removeprefix("data: ") for line in [*seen, *lines] if line.startswith("data: ")]
            return response.headers[REPLICA_HEADER], events


def turn_through_the_outage(conversation: dict, timeout_s: float = 90.0) -> tuple[dict, list[int]]:
    """The next turn, retried while the app answers 503 -> (its result, the statuses seen before it)."""
    statuses, deadline = [], time.monotonic() + timeout_s
    while True:
        try:
            return next_turn(f"http://127.0.0.1:{PORT}", conversation), statuses
        except httpx.HTTPStatusError as exc:
            response = exc.response
            assert response.status_code == 503 and response.headers.get("retry-after"), response.text
            assert response.json()["error"]["type"] == "server_unavailable"
            statuses.append(response.status_code)
            assert time.monotonic() < deadline, f"still 503 after {timeout_s} s: {response.text}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(serve_app, tiny_llama_dir):
    """Nodes A and B (one slot each) and the app on them -> a dict the scenarios share, in order."""
    from ray import serve

    nodes = {"A": add_node({SLOT: 1}), "B": add_node({SLOT: 1})}
    state = {"nodes": nodes, "base": f"http://127.0.0.1:{PORT}", "model_dir": tiny_llama_dir}
    try:
        deploy(app_config(tiny_llama_dir))
        state["replicas"] = replica_nodes(2)
        wait_until_routed_to_each(state["base"], sorted(state["replicas"]), MODEL)
        yield state
    finally:  # nodes first: replicas that died export nothing, so the app goes at once
        for node in nodes.values():
            stop_node(node)  # and the GCS knows: the next test's replicas are not placed on a dead node
        serve.delete(APP)


def test_turns_keep_their_node_and_n_choices_span_nodes(cluster):
    replicas, base = cluster["replicas"], cluster["base"]
    node_ids = {name: node.node_id for name, node in cluster["nodes"].items()}
    assert sorted(replicas.values()) == sorted([node_ids["A"], node_ids["B"]])  # one replica on each node
    conversations = spread_over(sorted(replicas), 8)
    for _ in range(3):
        for conversation in conversations:
            next_turn(base, conversation)
    for conversation in conversations:
        turns = conversation["turns"]
        assert len({t["replica"] for t in turns}) == 1, turns  # affinity, across turns
        for prev, cur in zip(turns, turns[1:]):  # the history came from cache: only the new tokens computed
            assert len(cur["prompt"]) - cur["cached"] <= len(cur["prompt"]) - len(prev["prompt"]) - \
                len(prev["completion"]) + BLOCK
    assert {c["turns"][0]["replica"] for c in conversations} == set(replicas)
    cluster["conversations"] = conversations

    # n = 4 on replicas that run 2 sequences each: the router spills the choices past the full one.
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "fan out: count to ten"}], "n": 4,
        "max_tokens": 64, "ignore_eos": True, "temperature": 1.0, "seed": 7})
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1, 2, 3]
    served = reply.headers[REPLICA_HEADER].split(",")
    assert {replicas[r] for r in served} == {node_ids["A"], node_ids["B"]}, served


def test_a_node_killed_mid_stream_fails_cleanly_and_conversations_continue_on_the_survivor(cluster):
    replicas, conversations = cluster["replicas"], cluster["conversations"]
    [victim] = [r for r, node in replicas.items() if node == cluster["nodes"]["B"].node_id]
    [survivor] = set(replicas) - {victim}
    doomed = next(c for c in conversations if c["turns"][-1]["replica"] == victim)
    body = {"model": MODEL, "messages": doomed["messages"], "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    served_by, events = stream_events(body, 4, lambda: kill_node(cluster["nodes"].pop("B")))
    assert served_by == victim
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_unavailable", events[-2]

    for conversation in conversations:  # the doomed one too: its turn is asked again
        result, _ = turn_through_the_outage(conversation)
        assert result["replica"] == survivor
        assert result["completion"] == cold_completion(cluster["model_dir"], result["prompt"])
    cluster["survivor"] = survivor


def test_a_node_added_takes_new_conversations_and_live_ones_stay(cluster):
    survivor, conversations = cluster["survivor"], cluster["conversations"]
    cluster["nodes"]["C"] = add_node({SLOT: 2})
    replicas = replica_nodes(2)  # Serve places the replica it lost on the new node
    [added] = set(replicas) - {survivor}
    assert replicas[added] == cluster["nodes"]["C"].node_id
    wait_until_routed_to_each(cluster["base"], sorted(replicas), MODEL)
    owners = {id(c): rendezvous_owner(route_key("", MODEL, messages=c["messages"][:1]), sorted(replicas))
              for c in conversations}
    assert added in owners.values(), "no live conversation hashes to the new replica: nothing could move"
    for conversation in conversations:  # held by the survivor: they stay, whoever owns their key now
        assert next_turn(cluster["base"], conversation)["replica"] == survivor
    for conversation in first_turns_owned_by(added, sorted(replicas), 3, "new on C"):
        assert next_turn(cluster["base"], conversation)["replica"] == added
    cluster["replicas"] = replicas


def test_a_drained_node_moves_its_conversations_to_another_node(cluster):
    survivor, conversations = cluster["survivor"], cluster["conversations"]
    drain_node(cluster["nodes"]["A"])
    replicas = replica_nodes(2, gone={survivor})  # started again on C, then the old one stopped and exported
    assert set(replicas.values()) == {cluster["nodes"]["C"].node_id}
    start = stats_of_each(set(replicas), APP)
    for conversation in conversations:
        result = next_turn(cluster["base"], conversation)
        assert result["replica"] in replicas
        assert result["retention"] == "retained", conversation["turns"]
        assert len(result["prompt"]) - result["cached"] <= new_tokens(conversation) + BLOCK
        assert result["completion"] == cold_completion(cluster["model_dir"], result["prompt"])
    end = stats_of_each(set(replicas), APP)
    imported = sum(end[r]["num_states_imported"] - start[r]["num_states_imported"] for r in replicas)
    assert imported == len(conversations)  # each from the depot, none recomputed


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
