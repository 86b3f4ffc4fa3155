"""BlockPool and KVCacheManager: exact block ids, reference counts, all-or-nothing allocation."""

import pytest

from core.messages import SamplingParams
from replicas.cache.block_pool import BlockPool
from replicas.cache.kv_cache_manager import KVCacheManager
from replicas.request.request import Request


def request(num_prompt: int) -> Request:
    return Request("r", list(range(num_prompt)), SamplingParams(), 8, frozenset())


def test_allocate_and_free_exact_ids():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts == [1, 1, 1, 0]
    pool.free([1])
    assert pool.num_free_blocks == 2 and pool.ref_counts == [1, 0, 1, 0]
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    with pytest.raises(AssertionError):
        pool.free([1])


def test_manager_allocates_by_block_and_refuses_without_change():
    manager = KVCacheManager(BlockPool(3), block_size=4)
    req = request(10)
    assert manager.allocate_slots(req, 10) and req.block_table == [0, 1, 2]
    req.num_computed_tokens = 10
    assert manager.allocate_slots(req, 2)  # tokens 10, 11 still fit block 2
    assert not manager.allocate_slots(req, 3)  # token 12 needs a 4th block
    assert req.block_table == [0, 1, 2]
    manager.free(req)
    assert req.block_table == [] and manager.pool.num_free_blocks == 3


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
