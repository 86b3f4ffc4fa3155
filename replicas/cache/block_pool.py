"""BlockPool: the fixed set of KV blocks, reference-counted, with hash-addressed reuse.

A block is in use while its reference count is above zero. A freed block keeps
its KV and its hash (if it was full and hashed) and waits in the free queue,
least recently freed first; it can be found by hash and taken back (`touch`)
until it is handed out again by `allocate`, which evicts its hash then. So
free blocks = blocks with no reference; evictable = free blocks with a hash.

`on_evict(block_id, block_hash)`, when set (the host tier's), is called as a hashed block is evicted,
while its KV is still intact: the caller of `allocate` overwrites it only afterwards.

Contract: `find` never modifies the pool; a block in use is never evicted.
"""

from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool holds no block: raise kv_cache_bytes")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id, for full blocks whose KV is valid
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.num_evictions = 0
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return sum(1 for block_id in self._free if self.block_hashes[block_id] is not None)

    def cached_hashes(self) -> list[bytes]:
        """A snapshot of the hashes whose KV is held (in use or free), oldest registered first."""
        return list(self.cached)  # one C-level copy: safe to call from another thread

    def find(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); a free one leaves the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop a reference; at zero the block joins the free queue's most-recent end, KV and hash kept."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def set_hash(self, block_id: int, block_hash: bytes) -> None:
        """Registers a full block's content hash; the first block with a given hash stays the one found."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
            self.num_evictions += 1
