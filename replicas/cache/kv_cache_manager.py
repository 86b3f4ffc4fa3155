"""KVCacheManager: gives each request the blocks its tokens need, and takes them back.

    block_table  [b0][b1][b2]         block_size = 4, 10 tokens computed or scheduled
    tokens        0..3 4..7 8 9 _ _   -> ceil(10 / 4) = 3 blocks
"""

from replicas.cache.block_pool import BlockPool
from replicas.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False (and no change) if the pool is short."""
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if num_needed <= 0:
            return True
        if num_needed > self.pool.num_free_blocks:
            return False
        request.block_table.extend(self.pool.allocate(num_needed))
        return True

    def free(self, request: Request) -> None:
        # Tail first, so the head of a sequence is the last to be reused.
        self.pool.free(request.block_table[::-1])
        request.block_table = []
