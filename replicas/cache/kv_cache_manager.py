"""KVCacheManager: gives each request the blocks its tokens need, reuses cached prefixes, takes blocks back.

    block_table  [b0][b1][b2]         block_size = 4, 10 tokens computed or scheduled
    tokens        0..3 4..7 8 9 _ _   -> ceil(10 / 4) = 3 blocks

Prefix reuse is by exact token ids only: full block i is found by the chained
hash of blocks 0..i (core.hashing.block_hashes, the router's function).
A hit never covers the last token: at least one token is computed, so the first
sampled token always has fresh logits (never an empty prefill). With a host tier
(`tier`, replicas/cache/host_tier.py), admission first brings back the tier's
blocks that continue the pool's hits, so the match finds them like any other.
"""

from core.hashing import block_hashes
from replicas.cache.block_pool import BlockPool
from replicas.request.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, reuse_blocks_alone: bool = True):
        self.pool = pool
        self.block_size = block_size
        # False for hybrid models: cached blocks are reused only with a state checkpoint (checkpointer.py).
        self.reuse_blocks_alone = reuse_blocks_alone
        self.tier = None  # a HostTier, when the engine has one

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, request: Request) -> None:
        """Extends request.block_hashes to every full block of its token ids (chained, incremental)."""
        num_full = request.num_tokens // self.block_size
        have = len(request.block_hashes)
        if num_full > have:
            start = have * self.block_size
            parent = request.block_hashes[-1] if have else None
            tokens = request.token_ids[start:num_full * self.block_size]
            request.block_hashes.extend(block_hashes(tokens, self.block_size, parent))

    def match_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix, not covering its last token.
        Does not modify the pool. A request that needs logits at every prompt position matches nothing."""
        if not self.pool.enable_caching or not self.reuse_blocks_alone or request.needs_prompt_logits:
            return []
        self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.find(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def admit(self, request: Request, num_new_tokens_budget: int) -> int | None:
        """Starts a request that holds no blocks: reuses its cached prefix, allocates for up to
        `num_new_tokens_budget` more tokens. Returns the tokens to compute now, or None (and no change)."""
        assert not request.block_table and request.num_computed_tokens == 0
        use_tier = self.tier is not None and self.reuse_blocks_alone and not request.needs_prompt_logits
        if use_tier:
            self.update_hashes(request)
            self.tier.restore(request.block_hashes, (request.num_tokens - 1) // self.block_size)
        hit = self.match_prefix(request)
        num_cached = len(hit) * self.block_size
        num_new = min(request.num_tokens - num_cached, num_new_tokens_budget)
        if not self.take(request, hit, num_cached, num_new):
            return None
        if use_tier:  # once per admission, not per attempt
            self.tier.note_use(request.block_hashes[:request.num_prompt_tokens // self.block_size])
        return num_new

    def take(self, request: Request, shared: list[int], num_computed: int, num_new: int) -> bool:
        """Gives a request that holds no blocks the cached full blocks `shared` (its first tokens, up to
        `num_computed`) and fresh blocks for the rest and `num_new` more. False (and no change) if short."""
        num_needed = self.num_blocks_for(num_computed + num_new) - len(shared)
        # Touching a free cached block takes it out of the free queue, so count those too.
        num_free_shared = sum(1 for b in shared if self.pool.ref_counts[b] == 0)
        if num_needed > self.pool.num_free_blocks - num_free_shared:
            return False
        self.pool.touch(shared)
        request.block_table = shared + self.pool.allocate(num_needed)
        request.num_computed_tokens = num_computed
        request.num_registered_blocks = len(shared)
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False (and no change) if the pool is short."""
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if num_needed <= 0:
            return True
        if num_needed > self.pool.num_free_blocks:
            return False
        request.block_table.extend(self.pool.allocate(num_needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: register the hashes of blocks that are now full of computed KV."""
        if not self.pool.enable_caching:
            return
        self.update_hashes(request)
        num_full = request.num_computed_tokens // self.block_size
        for i in range(request.num_registered_blocks, num_full):
            self.pool.set_hash(request.block_table[i], request.block_hashes[i])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def free(self, request: Request) -> None:
        # Tail first: the tail of a sequence is evicted before its head, which others share more often.
        self.pool.free(request.block_table[::-1])
        request.block_table = []
        request.num_registered_blocks = 0
