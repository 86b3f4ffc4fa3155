"""HostTier and its codec: packing is bit-exact; the store is bounded and drops by use; evicted blocks and
checkpoints come back exactly, in chain order, without evicting the prefix they continue."""

import pytest
import torch

from replicas.cache.block_io import read_blocks
from replicas.cache.block_pool import BlockPool
from replicas.cache.checkpoints import Checkpoint, CheckpointPool
from replicas.cache.host_tier import HostTier
from replicas.cache.kv_codec import pack, unpack

L, BS, HKV, D = 2, 4, 2, 8  # a block: [L, 2, BS, HKV, D], float32: 1024 bytes
BLOCK_BYTES = L * 2 * BS * HKV * D * 4
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def values(dtype: torch.dtype, n: int = 4096) -> torch.Tensor:
    """Awkward values first (signed zeros, infinities, NaN, subnormals, extremes), then KV-like ones."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny / 4, -info.tiny,
                            info.max, info.min, info.eps, 1.0, -1.0], dtype=torch.float32).to(dtype)
    gen = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-4, 3, (n,), generator=gen).float()
    return torch.cat([special, (torch.randn(n, generator=gen) * scales).to(dtype)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_codec_round_trip_is_bit_exact(dtype):
    x = values(dtype)[:4104].view(2, 3, 684)
    y = unpack(pack(x))
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(BITS[dtype]), x.view(BITS[dtype]))  # bits: NaN and -0.0 included


def test_codec_packs_bfloat16_and_takes_any_layout():
    x = values(torch.bfloat16, 1 << 14)
    assert pack(x).num_bytes < 0.8 * x.numel() * 2  # the exponent plane deflates; the mantissa plane is kept raw
    t = torch.randn(6, 5).t()  # not contiguous
    assert torch.equal(unpack(pack(t)), t)
    assert unpack(pack(torch.zeros(0, 3))).shape == (0, 3)


def make(num_blocks: int, tier_bytes: int, codec: str = "none"):
    pool = BlockPool(num_blocks)
    kv = [(torch.randn(num_blocks, BS, HKV, D), torch.randn(num_blocks, BS, HKV, D)) for _ in range(L)]
    tier = HostTier(tier_bytes, codec)
    tier.attach(pool, kv)
    return pool, kv, tier


def compute(pool: BlockPool, kv, hashes: list[bytes]) -> torch.Tensor:
    """A request computes blocks with `hashes` and finishes. -> their KV: [n, L, 2, BS, HKV, D]."""
    block_ids = pool.allocate(len(hashes))
    for block_id, block_hash in zip(block_ids, hashes):
        for k, v in kv:
            k[block_id].normal_()
            v[block_id].normal_()
        pool.set_hash(block_id, block_hash)
    blocks = read_blocks(kv, block_ids)
    pool.free(block_ids[::-1])
    return blocks


def held(pool: BlockPool, kv, hashes: list[bytes]) -> torch.Tensor:
    return read_blocks(kv, [pool.find(x) for x in hashes])


@pytest.mark.parametrize("codec", ["zlib", "none"])
def test_evicted_blocks_come_back_exactly_and_leave_the_tier(codec):
    pool, kv, tier = make(4, 1 << 20, codec)
    chain = [h(i) for i in range(4)]
    original = compute(pool, kv, chain)
    compute(pool, kv, [h(10 + i) for i in range(4)])  # evicts the whole chain, tail first
    assert all(pool.find(x) is None for x in chain) and tier.block_hashes() == chain[::-1]
    assert tier.restore(chain, 4) == 4
    assert torch.equal(held(pool, kv, chain), original)
    assert tier.block_hashes() == [h(10 + i) for i in range(4)][::-1]  # exclusive: the chain left, the others came
    assert tier.stats.num_blocks_restored == 4 and tier.stats.num_blocks_stored == 8
    assert all(c == 0 for c in pool.ref_counts)


def test_restore_continues_the_pools_hits_and_never_evicts_them():
    pool, kv, tier = make(3, 1 << 20)
    chain = [h(i) for i in range(3)]
    original = compute(pool, kv, chain)
    compute(pool, kv, [h(10), h(11)])  # evicts h2, h1 (the tail); h0 stays, least recently used
    assert pool.find(chain[0]) is not None and tier.block_hashes() == [chain[2], chain[1]]
    head = pool.find(chain[0])
    assert tier.restore(chain, 3) == 2
    assert pool.find(chain[0]) == head and torch.equal(held(pool, kv, chain), original)


def test_restore_stops_at_a_gap_and_at_max_blocks():
    pool, kv, tier = make(4, 1 << 20)
    chain = [h(i) for i in range(4)]
    blocks = torch.randn(4, L, 2, BS, HKV, D)
    tier.store_block(chain[1], blocks[1])
    tier.store_block(chain[3], blocks[3])
    assert tier.restore(chain, 4) == 0  # block 0 is nowhere: nothing after it is usable
    tier.store_block(chain[0], blocks[0])
    assert tier.restore(chain, 1) == 1 and tier.restore(chain, 4) == 1  # then 1; 2 is nowhere
    assert tier.block_hashes() == [chain[3]]


def test_bounded_drops_fewest_uses_first_and_refuses_a_newcomer_used_less():
    tier = HostTier(3 * BLOCK_BYTES, "none")
    block = torch.zeros(L, 2, BS, HKV, D)
    tier.note_use([h(0), h(0), h(1), h(3), h(5), h(6), h(6), h(6)])
    for i in (0, 1, 2):  # uses 2, 1, 0
        tier.store_block(h(i), block)
    tier.store_block(h(3), block)  # uses 1: pushes out h2 (0 uses)
    assert tier.block_hashes() == [h(0), h(1), h(3)]
    tier.store_block(h(4), block)  # 0 uses: every resident is used more
    tier.store_block(h(5), block)  # 1 use: ties never displace a resident (a cycle would churn)
    assert tier.block_hashes() == [h(0), h(1), h(3)]
    tier.store_block(h(6), block)  # 3 uses: pushes out the fewest used, stored first: h1
    assert tier.block_hashes() == [h(0), h(3), h(6)]
    assert tier.num_bytes == 3 * BLOCK_BYTES <= tier.max_bytes
    assert tier.stats.num_blocks_stored == 5 and tier.stats.num_blocks_dropped == 4


def test_uses_halve_every_sample():
    tier = HostTier(1 << 20, "none", sample_size=8)
    tier.note_use([h(0)] * 5 + [h(1)] * 2)
    assert tier.uses(h(0)) == 5 and tier.uses(h(1)) == 2
    tier.note_use([h(2)])  # the 8th note: everything halves, and a single use is forgotten
    assert (tier.uses(h(0)), tier.uses(h(1)), tier.uses(h(2))) == (2, 1, 0)


def checkpoint(num_tokens: int, seed: int) -> Checkpoint:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return Checkpoint(num_tokens, [r(6, 3)], [r(2, 4, 4)], [(r(num_tokens % BS, HKV, D), r(num_tokens % BS, HKV, D))],
                      r(16).to(torch.bfloat16), h(99))


def test_evicted_checkpoints_come_back_exactly():
    ids = list(range(100, 130))
    first, second = checkpoint(10, 0), checkpoint(21, 1)
    pool = CheckpointPool(max_bytes=first.num_bytes + 8)  # room for one
    tier = HostTier(1 << 20, "zlib")
    pool.on_evict = tier.store_checkpoint
    pool.save(ids[:10], first)
    pool.save(ids[:21], second)  # evicts the first to the tier
    assert len(pool) == 1 and tier.stats.num_checkpoints_stored == 1
    assert tier.take_checkpoints(ids, 9) == []  # longer than allowed
    [back] = tier.take_checkpoints(ids, 30)
    for a, b in zip([*back.conv_states, *back.recurrent_states, *back.tail_kv[0], back.hidden],
                    [*first.conv_states, *first.recurrent_states, *first.tail_kv[0], first.hidden]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.num_tokens == 10 and back.last_block_hash == h(99)
    assert len(tier) == 0 and tier.take_checkpoints(ids, 30) == []


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
