"""The cache router's policy on synthetic replica states, through real ConversationRouter instances.

The replicas are stand-ins with what a router reads of a RunningReplica (`replica_id`,
`max_ongoing_requests`, `routing_stats`); queue lengths go into the router's own cache,
as Serve's probes would put them. No Ray cluster is needed to construct a router.
"""

import asyncio
import random
import time

import pytest
from ray.serve._private.common import DeploymentID, DeploymentHandleSource, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from cache_router.policy import Candidates, PolicyConfig, choose
from cache_router.router import ConversationRouter
from core.hashing import block_hashes, rendezvous_owner, rendezvous_rank, short_hash
from core.messages import GenerateRequest, SamplingParams

DEPLOYMENT = DeploymentID(name="ModelReplica", app_name="test")
BLOCK = 4
SYSTEM_IDS = list(range(1000, 1024))  # 6 blocks every conversation shares


class Replica:
    def __init__(self, uid: str, routing_stats: dict | None = None, max_ongoing: int = 16):
        self.replica_id = ReplicaID(uid, DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing
        self.routing_stats = routing_stats or {}
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "", None, set()  # read by Serve's base

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def make_router(**kwargs) -> ConversationRouter:
    router = ConversationRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK, **kwargs)
    return router


def request(key: str, prompt: list[int], history: str | None = None, span=None) -> GenerateRequest:
    return GenerateRequest(f"req-{time.perf_counter_ns()}", prompt, SamplingParams(), route_key=key,
                           history_key=history, new_turn_span=span)


def pending(req: GenerateRequest) -> PendingRequest:
    """Needs a running event loop (it makes a future): call it inside `in_loop`."""
    return PendingRequest(args=[req], kwargs={},
                          metadata=RequestMetadata(request_id=req.request_id, internal_request_id="shared"))


def in_loop(fn):
    """Runs `fn()` inside an event loop, as Serve runs routers."""
    async def call():
        return await fn() if asyncio.iscoroutinefunction(fn) else fn()
    return asyncio.run(call())


def route(router: ConversationRouter, replicas: list[Replica], req: GenerateRequest,
          created_at: float | None = None) -> list[str]:
    async def choose_for():
        pr = pending(req)
        if created_at is not None:
            pr.created_at = created_at
        return await router.choose_replicas(replicas, pr)

    ranks = in_loop(choose_for)
    assert len(ranks) == 1, "the router returns one rank, never a fallback"
    return [r.replica_id.unique_id for r in ranks[0]]


def send(router: ConversationRouter, replicas: list[Replica], req: GenerateRequest) -> str:
    """Routes and tells the router the (first) choice accepted it, as Serve does."""
    chosen = route(router, replicas, req)[0]
    routed(router, req, chosen)
    return chosen


def routed(router: ConversationRouter, req: GenerateRequest, replica: str) -> None:
    in_loop(lambda: router.on_request_routed(pending(req), ReplicaID(replica, DEPLOYMENT), None))


def set_load(router: ConversationRouter, replica: Replica, ongoing: int) -> None:
    router.replica_queue_len_cache.update(replica.replica_id, ongoing)


def keys_owned_by(owner: str, others: list[str], count: int, prefix: str = "conv") -> list[str]:
    """Route keys whose rendezvous owner among [owner, *others] is `owner`."""
    ids = [owner, *others]
    found, i = [], 0
    while len(found) < count:
        if rendezvous_owner(f"{prefix}-{i}", ids) == owner:
            found.append(f"{prefix}-{i}")
        i += 1
    return found


def short_blocks(ids: list[int]) -> list[int]:
    return [short_hash(h) for h in block_hashes(ids, BLOCK)]


# --- 1. the conversation's replica ------------------------------------------------


def test_the_replica_holding_the_conversation_wins_within_the_threshold():
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    history = "ab" * 16
    b.routing_stats = {"conversations": [short_hash(history)], "blocks": []}
    router = make_router(imbalance_threshold=2)
    prompt = list(range(60))
    req = request(key, prompt, history=history, span=(50, 60))
    assert route(router, [a, b], req) == ["b"] and req.route_reason == "conversation"
    assert req.predicted_cached_tokens == {"a": 0, "b": 48}  # the history part of the render, whole blocks
    set_load(router, b, 3)  # 3 more than a's 0: beyond the threshold, the owner takes it
    set_load(router, a, 0)
    assert route(router, [a, b], req) == ["a"] and req.route_reason == "rendezvous"
    set_load(router, b, 2)  # within it again
    assert route(router, [a, b], req) == ["b"]


def test_a_router_follows_a_conversation_it_moved_before_any_report():
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    router = make_router(imbalance_threshold=1)
    set_load(router, a, 5)
    set_load(router, b, 0)
    assert route(router, [a, b], request(key, list(range(20)))) == ["a", "b"]  # balance: the framework picks b
    routed(router, request(key, list(range(20))), "b")
    set_load(router, a, 0)  # the owner is idle again: the next turn still goes where the conversation is
    turn2 = request(key, list(range(30)), history="cd" * 16, span=(22, 30))
    assert route(router, [a, b], turn2) == ["b"] and turn2.route_reason == "conversation"


def test_own_routing_records_expire_after_the_ttl():
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    router = make_router(knowledge_ttl_s=0.05)
    routed(router, request(key, list(range(20))), "b")
    assert route(router, [a, b], request(key, list(range(30)))) == ["b"]
    time.sleep(0.1)  # no report ever confirmed it: back to the owner
    assert route(router, [a, b], request(key, list(range(30)))) == ["a"]


# --- 2. the longest prefix ----------------------------------------------------------


@pytest.mark.parametrize("held_blocks, expected, reason", [(6, "b", "prefix"), (3, "a", "rendezvous")])
def test_a_longer_prefix_wins_above_the_minimum_match(held_blocks, expected, reason):
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    prompt = list(range(40))  # 10 blocks of 4
    b.routing_stats = {"blocks": short_blocks(prompt[:held_blocks * BLOCK]), "conversations": []}
    router = make_router(min_prefix_blocks=4)
    req = request(key, prompt)
    assert route(router, [a, b], req) == [expected] and req.route_reason == reason
    assert req.predicted_cached_tokens == {"a": 0, "b": held_blocks * BLOCK}


def test_a_prefix_match_counts_leading_blocks_only():
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    prompt = list(range(40))
    held = short_blocks(prompt)
    b.routing_stats = {"blocks": held[:1] + held[2:]}  # block 1 evicted: only block 0 is a usable prefix
    router = make_router(min_prefix_blocks=2)
    assert route(router, [a, b], request(key, prompt)) == ["a"]


def test_blocks_shared_by_several_conversations_earn_no_preference():
    a, b = Replica("a"), Replica("b")
    router = make_router(min_prefix_blocks=4)
    # Two conversations owned by b were sent there: the shared system prompt is now on b only.
    for key in keys_owned_by("b", ["a"], 2, prefix="early"):
        assert send(router, [a, b], request(key, SYSTEM_IDS + [1, 2, 3, 4])) == "b"
    # A new conversation owned by a starts with the same 6 blocks: they do not pull it to b.
    key = keys_owned_by("a", ["b"], 1, prefix="late")[0]
    req = request(key, SYSTEM_IDS + [7, 8, 9, 10])
    assert route(router, [a, b], req) == ["a"] and req.route_reason == "rendezvous"
    assert req.predicted_cached_tokens["b"] == len(SYSTEM_IDS)  # still predicted: b holds them


# --- 3. rendezvous ------------------------------------------------------------------


def test_two_router_instances_make_the_same_choices():
    replicas = [Replica(f"r{i}") for i in range(4)]
    first, second = make_router(), make_router()
    ids = [r.replica_id.unique_id for r in replicas]
    for i in range(200):
        key = f"conversation-{i}"
        one = route(first, replicas, request(key, list(range(i, i + 30))))
        other = route(second, list(reversed(replicas)), request(key, list(range(i, i + 30))))
        assert one == other == [rendezvous_owner(key, ids)]


def test_a_replica_that_is_gone_moves_only_its_conversations_to_their_next_choice():
    replicas = [Replica(f"r{i}") for i in range(4)]
    ids = [r.replica_id.unique_id for r in replicas]
    router = make_router()
    live = [r for r in replicas if r.replica_id.unique_id != "r2"]
    for i in range(200):
        key = f"conversation-{i}"
        rank = rendezvous_rank(key, ids)
        expected = rank[1] if rank[0] == "r2" else rank[0]
        assert route(router, live, request(key, list(range(30)))) == [expected]


def test_adding_a_replica_moves_few_conversations_and_no_held_one():
    old = [Replica(f"r{i}") for i in range(4)]
    new = old + [Replica("r4")]
    keys = [f"conversation-{i}" for i in range(1000)]
    router = make_router()
    before = {k: route(router, old, request(k, list(range(30))))[0] for k in keys}
    after = {k: route(router, new, request(k, list(range(30))))[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert len(moved) / len(keys) <= 1 / len(new) + 0.10
    assert {after[k] for k in moved} == {"r4"}  # only onto the new replica
    # Conversations a replica reports holding stay there, whatever the new rendezvous owner.
    for replica in old:
        mine = [k for k in keys if before[k] == replica.replica_id.unique_id]
        replica.routing_stats = {"conversations": [short_hash(f"{k:0>32}".encode().hex()) for k in mine]}
    for k in moved:
        history = f"{k:0>32}".encode().hex()
        assert route(router, new, request(k, list(range(30)), history=history, span=(20, 30))) == [before[k]]


def test_reports_are_taken_in_when_serve_hands_over_the_replicas():
    """Serve delivers new routing stats through `update_replicas` (each RunningReplicaInfo broadcast): the
    knowledge has them before the next decision; a replica that goes leaves nothing behind."""
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    key, history = keys_owned_by("a", ["b", "c"], 1)[0], "ef" * 16
    b.routing_stats = {"conversations": [short_hash(history)], "blocks": []}

    async def scenario():  # one event loop, as Serve's router has
        router = make_router()
        router.update_replicas([a, b])
        assert router.knowledge.conversation_holders(router.knowledge.live(["a", "b"]), short_hash(history),
                                                     None) == ["b"]
        first = await router.choose_replicas([a, b], pending(request(key, list(range(30)), history, (20, 30))))
        router.update_replicas([a, c])  # b goes; c takes its slot
        then = await router.choose_replicas([a, c], pending(request(key, list(range(30)), history, (20, 30))))
        return [r.replica_id.unique_id for r in first[0]], [r.replica_id.unique_id for r in then[0]]

    assert in_loop(scenario) == (["b"], ["a"])


# --- 4. imbalance -------------------------------------------------------------------


def test_imbalance_falls_back_to_the_least_loaded_of_two_choices():
    replicas = [Replica(f"r{i}") for i in range(4)]
    ids = [r.replica_id.unique_id for r in replicas]
    key = "hot-conversation"
    owner, runner_up = rendezvous_rank(key, ids)[:2]
    router = make_router(imbalance_threshold=8)
    for r in replicas:
        set_load(router, r, 0)
    set_load(router, replicas[ids.index(owner)], 9)
    req = request(key, list(range(30)))
    assert route(router, replicas, req) == [owner, runner_up] and req.route_reason == "balance"
    set_load(router, replicas[ids.index(owner)], 8)  # at the threshold: still the owner's
    assert route(router, replicas, request(key, list(range(30)))) == [owner]


def test_a_full_replica_is_never_the_only_choice():
    a, b = Replica("a", max_ongoing=4), Replica("b", max_ongoing=4)
    key = keys_owned_by("a", ["b"], 1)[0]
    router = make_router(imbalance_threshold=100)
    set_load(router, a, 4)
    set_load(router, b, 3)
    assert route(router, [a, b], request(key, list(range(30)))) == ["a", "b"]


def test_requests_without_a_key_or_waiting_too_long_go_to_any_replica():
    a, b = Replica("a"), Replica("b")
    router = make_router(max_wait_s=0.01)
    req = request(None, list(range(30)))
    assert sorted(route(router, [a, b], req)) == ["a", "b"] and req.route_reason == "load"
    old = request("k", list(range(30)))
    assert len(route(router, [a, b], old, created_at=time.time() - 1)) == 2 and old.route_reason == "waited"


def candidates(*rows) -> Candidates:
    """Rows of (replica id, queue length or None, max ongoing[, holds the conversation[, matched blocks]])."""
    rows = [(row + (False, 0))[:5] for row in rows]
    by_matched = {}
    for replica_id, *_, matched in rows:
        if matched:
            by_matched.setdefault(matched, []).append(replica_id)
    queue_lens = {row[0]: row[1] for row in rows}
    max_ongoing = {row[0]: row[2] for row in rows}
    return Candidates([row[0] for row in rows], queue_lens.get, max_ongoing.get,
                      [row[0] for row in rows if row[3]], by_matched)


def test_the_pure_policy_prefers_held_then_prefix_then_owner():
    config = PolicyConfig(imbalance_threshold=4, min_prefix_blocks=2)
    key = keys_owned_by("a", ["b", "c"], 1)[0]
    owner_only = candidates(("a", 0, 8), ("b", 0, 8), ("c", 0, 8))
    assert choose(owner_only, key, config).replica_ids == ["a"]
    prefix = candidates(("a", 0, 8), ("b", 0, 8, False, 3), ("c", 0, 8))
    assert choose(prefix, key, config) .reason == "prefix"
    assert choose(prefix, key, config, shared_blocks=2).reason == "rendezvous"
    held = candidates(("a", 0, 8), ("b", 0, 8, False, 3), ("c", 4, 8, True))
    assert choose(held, key, config).replica_ids == ["c"]



def naive_choose(rows, key: str, config: PolicyConfig, shared_blocks: int) -> tuple[list[str], str]:
    """The policy's steps written plainly over every candidate (the first form of cache_router/policy.py): rows of
    (replica id, queue length or None, max ongoing, holds the conversation, matched blocks)."""
    by_id = {row[0]: row for row in rows}
    ranked = [by_id[rid] for rid in rendezvous_rank(key, list(by_id))]
    floor = min((row[1] for row in rows if row[1] is not None), default=0)

    def within_load(row) -> bool:
        return row[1] is None or (row[1] < row[2] and row[1] - floor <= config.imbalance_threshold)

    def own(row) -> int:
        return max(0, row[4] - shared_blocks)

    holders = [row for row in ranked if row[3]]
    best = max(ranked, key=own)
    best = best if own(best) - own(ranked[0]) >= config.min_prefix_blocks else None
    owner = ranked[0]
    for row, reason in [(h, "conversation") for h in holders] + [(best, "prefix"), (owner, "rendezvous")]:
        if row is not None and within_load(row):
            return [row[0]], reason
    preferred = holders[0] if holders else best or owner
    second = next((row for row in ranked if row is not preferred), None)
    return [preferred[0]] + ([second[0]] if second else []), "balance"


def test_the_policy_decides_as_its_plain_form_on_random_states():
    rng = random.Random(7)
    for case in range(3000):
        rows = [(f"r{i}", rng.choice([None] + list(range(13))), rng.choice([4, 8, 16]), rng.random() < 0.2,
                 rng.choice([0, 0, 1, 2, 3, 5, 8])) for i in range(rng.randint(1, 6))]
        config = PolicyConfig(imbalance_threshold=rng.randint(0, 4), min_prefix_blocks=rng.randint(0, 3))
        key, shared = f"conversation-{case}", rng.randint(0, 3)
        choice = choose(candidates(*rows), key, config, shared)
        assert (choice.replica_ids, choice.reason) == naive_choose(rows, key, config, shared), (rows, config, shared)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
