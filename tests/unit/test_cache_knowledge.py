"""CacheKnowledge with host tiers: blocks a replica reports in its host tier count as held (a tier hit is
served from cache), leading blocks only, whether the pool or the tier holds each; a new report replaces them."""

import pytest

from cache_router.knowledge import CacheKnowledge
from tests.unit.test_router_policy import BLOCK, Replica, keys_owned_by, make_router, request, route, short_blocks

PROMPT = list(range(40))  # 10 blocks of 4


def test_tier_blocks_count_as_held_leading_blocks_only():
    knowledge = CacheKnowledge()
    held = short_blocks(PROMPT)
    knowledge.observe_report("a", {"blocks": held[:2] + held[4:5], "tier_blocks": held[2:4], "conversations": []})
    assert knowledge.matched_blocks("a", held) == 5  # pool 0-1, tier 2-3, pool 4
    knowledge.observe_report("a", {"blocks": held[:2], "tier_blocks": held[3:6]})  # block 2 left the tier
    assert knowledge.matched_blocks("a", held) == 2
    knowledge.observe_report("a", {"blocks": [], "tier_blocks": held[:3]})
    assert knowledge.matched_blocks("a", held) == 3 and knowledge.matched_blocks("b", held) == 0


@pytest.mark.parametrize("key_name", ["blocks", "tier_blocks"])
def test_the_router_sends_a_prefix_to_the_replica_whose_tier_holds_it(key_name):
    a, b = Replica("a"), Replica("b")
    key = keys_owned_by("a", ["b"], 1)[0]
    b.routing_stats = {key_name: short_blocks(PROMPT[:6 * BLOCK]), "conversations": []}
    req = request(key, PROMPT)
    assert route(make_router(min_prefix_blocks=4), [a, b], req) == ["b"] and req.route_reason == "prefix"
    assert req.predicted_cached_tokens == {"a": 0, "b": 6 * BLOCK}


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
