"""BlockPool: the fixed set of KV blocks, reference-counted.

A block is free when its reference count is zero. The pool only counts; which
sequence holds which block is the KVCacheManager's business.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool holds no block: raise kv_cache_bytes")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free_block_ids):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free_block_ids)} free")
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
