"""CacheKnowledge with host tiers: blocks a replica reports in its host tier count as held (a tier hit is
served from cache), leading blocks only, whether the pool or the tier holds each; a new report replaces them."""

import random
from collections import OrderedDict

import pytest

from cache_router.knowledge import CacheKnowledge
from tests.unit.test_router_policy import BLOCK, Replica, keys_owned_by, make_router, request, route, short_blocks

PROMPT = list(range(40))  # 10 blocks of 4


def matched(knowledge: CacheKnowledge, replica_id: str, blocks: list[int], now: float | None = None) -> int:
    """How many leading blocks the knowledge believes `replica_id` holds."""
    by_count = knowledge.matched_blocks(knowledge.live([replica_id]), blocks, now)
    return next((count for count, ids in by_count.items() if replica_id in ids), 0)


def test_tier_blocks_count_as_held_leading_blocks_only():
    knowledge = CacheKnowledge()
    held = short_blocks(PROMPT)
    knowledge.observe_report("a", {"blocks": held[:2] + held[4:5], "tier_blocks": held[2:4], "conversations": []})
    assert matched(knowledge, "a", held) == 5  # pool 0-1, tier 2-3, pool 4
    knowledge.observe_report("a", {"blocks": held[:2], "tier_blocks": held[3:6]})  # block 2 left the tier
    assert matched(knowledge, "a", held) == 2
    knowledge.observe_report("a", {"blocks": [], "tier_blocks": held[:3]})
    assert matched(knowledge, "a", held) == 3 and matched(knowledge, "b", held) == 0


@pytest.mark.parametrize("key_name", ["blocks", "tier_blocks"])
def test_the_router_sends_a_prefix_to_the_replica_whose_tier_holds_it(key_name):
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    b.routing_stats = {key_name: short_blocks(PROMPT[:6 * BLOCK]), "conversations": []}
    req = request(key, PROMPT)
    assert route(make_router(min_prefix_blocks=4), [a, b], req) == ["b"] and req.route_reason == "prefix"
    assert req.predicted_cached_tokens == {"a": 0, "b": 6 * BLOCK}



def test_a_replica_in_a_freed_slot_inherits_nothing():
    knowledge, held = CacheKnowledge(), short_blocks(PROMPT)
    knowledge.observe_report("b", {"blocks": held, "conversations": [7]})
    knowledge.record_routed("b", "key", held)
    knowledge.retain_only(["a"])
    live = knowledge.live(["a", "c"])  # c takes b's slot
    assert knowledge.matched_blocks(live, held) == {}
    assert knowledge.conversation_holders(live, 7, "key") == []
    knowledge.observe_report("c", {"blocks": held[:3]})
    assert matched(knowledge, "c", held) == 3

class NaiveKnowledge:
    """What CacheKnowledge answers, one replica at a time (its first form): the sets of the latest report, and
    an LRU of routed blocks and of routed keys, each bounded to `max_entries`, fresh for `ttl_s`."""

    def __init__(self, ttl_s: float, max_entries: int):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self.replicas: dict[str, dict] = {}

    def _view(self, replica_id: str) -> dict:
        return self.replicas.setdefault(replica_id, {"blocks": set(), "conversations": set(),
                                                     "routed_blocks": OrderedDict(), "routed_keys": OrderedDict()})

    def observe_report(self, replica_id: str, report: dict) -> None:
        if report:
            view = self._view(replica_id)
            view["blocks"] = set(report.get("blocks", ())) | set(report.get("tier_blocks", ()))
            view["conversations"] = set(report.get("conversations", ()))

    def record_routed(self, replica_id: str, route_key: str, blocks: list[int], now: float) -> None:
        view = self._view(replica_id)
        for table, keys in (("routed_blocks", blocks), ("routed_keys", [route_key])):
            for key in keys:
                view[table][key] = now
                view[table].move_to_end(key)
            while len(view[table]) > self.max_entries:
                view[table].popitem(last=False)

    def _fresh(self, view: dict, table: str, key, now: float) -> bool:
        return key in view[table] and now - view[table][key] <= self.ttl_s

    def holds(self, replica_id: str, history: int, route_key: str, now: float) -> bool:
        view = self._view(replica_id)
        return history in view["conversations"] or self._fresh(view, "routed_keys", route_key, now)

    def matched(self, replica_id: str, blocks: list[int], now: float) -> int:
        view, count = self._view(replica_id), 0
        while count < len(blocks) and (blocks[count] in view["blocks"]
                                       or self._fresh(view, "routed_blocks", blocks[count], now)):
            count += 1
        return count

    def retain_only(self, replica_ids) -> None:
        self.replicas = {rid: view for rid, view in self.replicas.items() if rid in replica_ids}


def test_the_knowledge_answers_for_all_replicas_at_once_as_for_each_alone():
    """Random reports, routing, time and departures: every answer equals the plain form's."""
    rng = random.Random(3)
    names, chain = ["a", "b", "c", "d", "e"], list(range(100, 112))  # a prompt's blocks are a prefix of chain
    knowledge, naive, now = CacheKnowledge(ttl_s=5.0, max_entries=6), NaiveKnowledge(5.0, 6), 0.0
    for _ in range(3000):
        now += rng.choice([0.0, 0.5, 2.0])
        replica_id, op = rng.choice(names), rng.random()
        if op < 0.2:
            report = {"blocks": rng.sample(chain, rng.randint(0, 8)), "tier_blocks": rng.sample(chain, 2),
                      "conversations": rng.sample(range(6), rng.randint(0, 3))} if rng.random() < 0.9 else {}
            knowledge.observe_report(replica_id, report)
            naive.observe_report(replica_id, report)
        elif op < 0.5:
            key, blocks = f"k{rng.randint(0, 5)}", chain[:rng.randint(0, len(chain))]
            knowledge.record_routed(replica_id, key, blocks, now)
            naive.record_routed(replica_id, key, blocks, now)
        elif op < 0.55:
            kept = rng.sample(names, rng.randint(1, len(names)))
            knowledge.retain_only(kept)
            naive.retain_only(kept)
        live = rng.sample(names, rng.randint(1, len(names)))
        blocks, history, key = chain[:rng.randint(0, len(chain))], rng.randint(0, 6), f"k{rng.randint(0, 5)}"
        by_count = knowledge.matched_blocks(knowledge.live(live), blocks, now)
        assert {rid: n for n, ids in by_count.items() for rid in ids} == {
            rid: naive.matched(rid, blocks, now) for rid in live if naive.matched(rid, blocks, now)}
        assert sorted(knowledge.conversation_holders(knowledge.live(live), history, key, now)) == sorted(
            rid for rid in live if naive.holds(rid, history, key, now))


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
