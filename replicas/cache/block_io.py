"""Block I/O: copies whole KV blocks out of the paged pool and back in, for the states that move.

    kv_caches   per KV layer (k, v): [num_blocks, block_size, Hkv, D]      (the engine's pool)
    blocks      [n, L, 2, block_size, Hkv, D]                              (n blocks, every KV layer, k then v)

`read_blocks` copies (the pool's blocks may be reused right after); `write_blocks` overwrites the
pool's blocks with `blocks`. `insert_cached` puts blocks whose chained hashes are known into the pool as
cached, unreferenced blocks (found by `BlockPool.find`, evictable by LRU), as if a request had computed
and freed them: an import (replicas/engine/migration.py) and a host-tier restore go through it.
"""

import torch

from replicas.cache.block_pool import BlockPool


def read_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> torch.Tensor:
    """-> [n, L, 2, block_size, Hkv, D], a copy."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    return torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1)
                        for k, v in kv_caches], dim=1)


def write_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 blocks: torch.Tensor) -> None:
    """blocks: [n, L, 2, block_size, Hkv, D] -> the pool's blocks `block_ids` (same dtype and shape)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    blocks = blocks.to(kv_caches[0][0].device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, blocks[:, layer, 0])
        v.index_copy_(0, index, blocks[:, layer, 1])


def insert_cached(pool: BlockPool, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  hashes: list[bytes], blocks: torch.Tensor) -> int:
    """Makes the pool hold `blocks` (one per hash, in chain order) as cached free blocks. A hash already
    held is left as it is; stops at the first block the pool has no free block for (a block in use is
    never taken). -> how many leading hashes the pool now holds."""
    if not pool.enable_caching:
        return 0
    taken = []  # referenced while inserting, so no allocation here evicts a block of this chain
    written, rows = [], []  # the blocks allocated here, and which of `blocks` each one takes
    for i, block_hash in enumerate(hashes):
        block_id = pool.find(block_hash)
        if block_id is not None:
            pool.touch([block_id])
        elif pool.num_free_blocks == 0:
            break
        else:
            [block_id] = pool.allocate(1)
            pool.set_hash(block_id, block_hash)
            written.append(block_id)
            rows.append(i)
        taken.append(block_id)
    if written:  # one copy for them all
        write_blocks(kv_caches, written, blocks[rows])
    pool.free(taken[::-1])  # tail first, as a finished request frees: its tail is evicted before its head
    return len(taken)
