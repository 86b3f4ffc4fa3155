"""RetainedStore (LRU under a token budget, namespaced by caller) and the turn terminator splice."""

import pytest

from replicas.cache.retained import RetainedStore
from replicas.engine.retention import rest_of_terminator


def test_store_is_namespaced_by_caller_and_bounded_lru():
    store = RetainedStore(max_tokens=10)
    store.put("k1", "alice", [1, 2, 3, 4])
    assert store.get("k1", "bob") is None  # another caller never sees alice's ids
    assert store.get("k1", "alice") == [1, 2, 3, 4]
    store.put("k2", "alice", [5, 6, 7])
    store.get("k1", "alice")  # k1 is now the most recent
    store.put("k3", "alice", [8, 9, 10, 11])  # 11 tokens > 10: the least recent (k2) goes
    assert store.get("k2", "alice") is None and store.get("k1", "alice") == [1, 2, 3, 4]
    assert store.num_tokens == 8 and store.num_evictions == 1
    store.put("huge", "alice", list(range(11)))  # never fits: not stored, nothing evicted
    assert store.get("huge", "alice") is None and len(store) == 2


@pytest.mark.parametrize("ids,terminator,rest", [
    ([5, 6, 2], [2, 198], [198]),  # ended on EOS: no doubled EOS
    ([5, 6], [2, 198], [2, 198]),  # cut by length: the whole terminator
    ([5, 2, 198], [2, 198], []),
    ([5, 198], [2, 198], [2, 198]),  # a "\n" alone is not the start of the terminator
])
def test_rest_of_terminator(ids, terminator, rest):
    assert rest_of_terminator(ids, terminator) == rest


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
