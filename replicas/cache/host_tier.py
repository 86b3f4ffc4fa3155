"""HostTier: evicted KV blocks and hybrid checkpoints kept in host memory, packed, and brought back on a hit.

    BlockPool evicts block (hash h)      -> store_block(h, kv)             kv: [L, 2, block_size, Hkv, D]
    CheckpointPool evicts (prefix key k) -> store_checkpoint(k, checkpoint)
    a request is admitted                -> note_use(its prompt's block hashes)
                                            restore(hashes, n): the tier's run of blocks right after the pool's
                                            hits goes back into the pool (block_io.insert_cached), before the match
                                            take_checkpoints(ids, n): hybrid checkpoints of the leading ids

Exact by construction: an entry is keyed by the chained hash of its block (or the prefix hash of its
checkpoint), packed losslessly (kv_codec: bit for bit), and restored only where the pool would have
matched it; a checkpoint still restores only with the full blocks of exactly its prefix (checkpointer.py).

Exclusive: a restored entry leaves the tier (the pool holds it now; evicted again, it is stored again), so
the pool and the tier never spend bytes on one block twice.

Policy, by use, not recency: every admission notes the full-block hashes of its prompt (`uses`, halved
every `sample_size` notes so old use fades). When the tier is full, the entry with the fewest uses goes
first (ties: the one stored first), and a newcomer that would have to displace an entry used as often
or more is not admitted. A checkpoint is worth what the last full block of its prefix is worth (it goes
when its chain's tail would). Why not LRU: conversations revisited round-robin by more than pool + tier
hold evict one another in a cycle, and LRU keeps exactly the blocks needed last. By use, a conversation's
head blocks, part of every later turn's prompt, outrank its newest ones: the tier keeps a stable set of
prefixes, and a chain loses its tail before its head (bench/engine/host_tier.py: with a tier of the pool's
bytes, 0.425 of prompt tokens from cache against LRU's 0.253; docs/benchmarks.md).
"""

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from core.hashing import prefix_hash
from replicas.cache.block_io import insert_cached, read_blocks
from replicas.cache.block_pool import BlockPool
from replicas.cache.checkpoints import Checkpoint
from replicas.cache.kv_codec import pack, unpack

CODECS = ("zlib", "none")  # zlib: byte planes, the top one deflated (kv_codec); none: a raw copy


@dataclass
class TierStats:
    num_blocks_stored: int = 0
    num_blocks_restored: int = 0  # hits: blocks put back into the pool
    num_blocks_dropped: int = 0  # not admitted, or pushed out later by an entry used more: gone
    num_checkpoints_stored: int = 0
    num_checkpoints_restored: int = 0
    num_checkpoints_dropped: int = 0
    num_packed_bytes_stored: int = 0  # over every store: bytes after packing ...
    num_raw_bytes_stored: int = 0  # ... and before (their ratio is the codec's)
    pack_seconds: float = 0.0  # on the caller's thread (the step thread)
    restore_seconds: float = 0.0  # unpacking and writing restored blocks and checkpoints back


@dataclass(slots=True)
class _Entry:
    is_block: bool
    payload: object  # a block: Packed or a tensor; a checkpoint: (num_tokens, counts, tensors, last_block_hash)
    num_bytes: int  # held (packed)
    num_raw_bytes: int
    uses: int  # the bucket it sits in


class HostTier:
    def __init__(self, max_bytes: int, codec: str = "zlib", sample_size: int = 1 << 16):
        if codec not in CODECS:
            raise ValueError(f"host tier codec must be one of {CODECS}, got {codec!r}")
        self.max_bytes = max_bytes
        self.codec = codec
        self.sample_size = sample_size
        self.num_bytes = 0
        self.num_raw_bytes = 0
        self.stats = TierStats()
        self._entries: dict[bytes, _Entry] = {}
        self._by_uses: dict[int, OrderedDict[bytes, None]] = {}  # uses -> keys, stored first first
        self._uses: dict[bytes, int] = {}
        self._num_noted = 0
        self._lengths: Counter[int] = Counter()  # checkpoints held, by num_tokens
        self.pool: BlockPool | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.device = torch.device("cpu")  # where restored checkpoints go (the engine's)

    def attach(self, pool: BlockPool, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Takes the pool's evicted hashed blocks from now on; restores go into the same pool."""
        self.pool, self.kv_caches = pool, kv_caches
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        pool.on_evict = self._on_pool_evict

    def __len__(self) -> int:
        return len(self._entries)

    def block_hashes(self) -> list[bytes]:
        """A snapshot of the blocks held, oldest stored first (safe from another thread: one C-level copy)."""
        return [key for key, entry in list(self._entries.items()) if entry.is_block]

    def has_block(self, block_hash: bytes) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.is_block

    # -- use ------------------------------------------------------------------

    def uses(self, key: bytes) -> int:
        return self._uses.get(key, 0)

    def note_use(self, keys: list[bytes]) -> None:
        """These blocks were part of an admitted request's prompt. Every `sample_size` notes, all counts halve."""
        for key in keys:
            uses = self._uses.get(key, 0) + 1
            self._uses[key] = uses
            entry = self._entries.get(key)
            if entry is not None:
                self._move(key, entry, uses)
        self._num_noted += len(keys)
        if self._num_noted >= self.sample_size:
            self._halve()

    def _halve(self) -> None:
        self._uses = {key: uses // 2 for key, uses in self._uses.items() if uses > 1}
        self._num_noted = 0
        for key, entry in list(self._entries.items()):
            self._move(key, entry, entry.uses // 2)

    def _move(self, key: bytes, entry: _Entry, uses: int) -> None:
        if uses == entry.uses:
            return
        self._unbucket(key, entry)
        entry.uses = uses
        self._by_uses.setdefault(uses, OrderedDict())[key] = None

    def _unbucket(self, key: bytes, entry: _Entry) -> None:
        bucket = self._by_uses[entry.uses]
        del bucket[key]
        if not bucket:
            del self._by_uses[entry.uses]

    # -- store ----------------------------------------------------------------

    def _on_pool_evict(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self._entries:
            return  # recomputed while the tier held it: kept once
        if not self._admits(self._uses.get(block_hash, 0)):
            self.stats.num_blocks_dropped += 1
            return
        self.store_block(block_hash, read_blocks(self.kv_caches, [block_id])[0])  # [L, 2, bs, Hkv, D]

    def store_block(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """kv: [L, 2, block_size, Hkv, D], the block's KV (copied or packed here: it may change after)."""
        if block_hash in self._entries:
            return
        start = time.perf_counter()
        kv = kv.cpu()  # host memory (a no-op on CPU)
        payload = pack(kv) if self.codec == "zlib" else kv.clone()
        num_bytes = _payload_bytes(payload)
        self.stats.pack_seconds += time.perf_counter() - start
        if self._add(block_hash, _Entry(True, payload, num_bytes, _tensor_bytes(kv), self.uses(block_hash))):
            self.stats.num_blocks_stored += 1
        else:
            self.stats.num_blocks_dropped += 1

    def store_checkpoint(self, key: bytes, checkpoint: Checkpoint) -> None:
        """A checkpoint evicted from the CheckpointPool, under its prefix hash. It is worth what the last full
        block of its prefix is worth: a chain's checkpoint goes when its tail would."""
        if key in self._entries:
            return
        uses = self.uses(checkpoint.last_block_hash) if checkpoint.last_block_hash else 0
        if not self._admits(uses):
            self.stats.num_checkpoints_dropped += 1
            return
        start = time.perf_counter()
        tensors = [*checkpoint.conv_states, *checkpoint.recurrent_states,
                   *(t for kv in checkpoint.tail_kv for t in kv), checkpoint.hidden]
        packed = [pack(t.cpu()) if self.codec == "zlib" else t.cpu().clone() for t in tensors]
        counts = (len(checkpoint.conv_states), len(checkpoint.tail_kv))
        num_bytes = sum(map(_payload_bytes, packed))
        self.stats.pack_seconds += time.perf_counter() - start
        entry = _Entry(False, (checkpoint.num_tokens, counts, packed, checkpoint.last_block_hash), num_bytes,
                       checkpoint.num_bytes, uses)
        if self._add(key, entry):
            self._lengths[checkpoint.num_tokens] += 1
            self.stats.num_checkpoints_stored += 1
        else:
            self.stats.num_checkpoints_dropped += 1

    def _admits(self, uses: int) -> bool:
        """Whether a newcomer with `uses` could get in: room left, or an entry used less to push out."""
        if self.num_bytes < self.max_bytes:
            return True
        return bool(self._by_uses) and min(self._by_uses) < uses

    def _add(self, key: bytes, entry: _Entry) -> bool:
        """Holds `entry` if room can be made by dropping entries used less than it. -> held."""
        victims, room = [], self.max_bytes - self.num_bytes
        for uses in sorted(self._by_uses):  # fewest uses first; within, stored first first
            if room >= entry.num_bytes or uses >= entry.uses:
                break
            for victim in self._by_uses[uses]:
                if room >= entry.num_bytes:
                    break
                victims.append(victim)
                room += self._entries[victim].num_bytes
        if room < entry.num_bytes:
            return False
        for victim in victims:
            dropped = self._remove(victim)
            if dropped.is_block:
                self.stats.num_blocks_dropped += 1
            else:
                self.stats.num_checkpoints_dropped += 1
        self._entries[key] = entry
        self._by_uses.setdefault(entry.uses, OrderedDict())[key] = None
        self.num_bytes += entry.num_bytes
        self.num_raw_bytes += entry.num_raw_bytes
        self.stats.num_packed_bytes_stored += entry.num_bytes
        self.stats.num_raw_bytes_stored += entry.num_raw_bytes
        return True

    def _remove(self, key: bytes) -> _Entry:
        entry = self._entries.pop(key)
        self._unbucket(key, entry)
        self.num_bytes -= entry.num_bytes
        self.num_raw_bytes -= entry.num_raw_bytes
        if not entry.is_block:
            num_tokens = entry.payload[0]
            self._lengths[num_tokens] -= 1
            if not self._lengths[num_tokens]:
                del self._lengths[num_tokens]
        return entry

    # -- restore --------------------------------------------------------------

    def restore(self, hashes: list[bytes], max_blocks: int) -> int:
        """Before a prefix match on `hashes` (a request's chained block hashes): the tier's blocks that
        continue the pool's hits, at most up to `max_blocks`, go back into the pool as cached free blocks
        (as many as the pool has free blocks for). -> blocks restored."""
        pool = self.pool
        hashes = hashes[:max_blocks]
        hits = []
        for block_hash in hashes:
            block_id = pool.find(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        start = end = len(hits)
        room = pool.num_free_blocks - sum(1 for b in hits if pool.ref_counts[b] == 0)
        while end < len(hashes) and end - start < room and self.has_block(hashes[end]):
            end += 1
        if end == start:
            return 0
        began = time.perf_counter()
        blocks = torch.stack([self._unpack_block(self._remove(h)) for h in hashes[start:end]])
        pool.touch(hits)  # so that inserting evicts none of the hits
        num_held = insert_cached(pool, self.kv_caches, hashes[start:end], blocks)  # [n, L, 2, bs, Hkv, D]
        pool.free(hits[::-1])
        for i in range(num_held, end - start):  # no free block after all: back into the tier
            self.store_block(hashes[start + i], blocks[i])
        self.stats.num_blocks_restored += num_held
        self.stats.restore_seconds += time.perf_counter() - began
        return num_held

    def take_checkpoints(self, token_ids: list[int], max_tokens: int, min_tokens: int = 0) -> list[Checkpoint]:
        """The tier's checkpoints of leading parts of `token_ids`, longer than `min_tokens` and at most
        `max_tokens` long, longest first; they leave the tier (the caller puts them in its CheckpointPool)."""
        found = []
        for length in sorted((n for n in self._lengths if min_tokens < n <= max_tokens), reverse=True):
            key = prefix_hash(token_ids[:length])
            if key in self._entries:
                began = time.perf_counter()
                found.append(self._unpack_checkpoint(self._remove(key)))
                self.stats.num_checkpoints_restored += 1
                self.stats.restore_seconds += time.perf_counter() - began
        return found

    def _unpack_block(self, entry: _Entry) -> torch.Tensor:
        return unpack(entry.payload) if self.codec == "zlib" else entry.payload

    def _unpack_checkpoint(self, entry: _Entry) -> Checkpoint:
        num_tokens, (num_linear, num_kv), packed, last_block_hash = entry.payload
        tensors = [(unpack(p) if self.codec == "zlib" else p).to(self.device) for p in packed]
        conv, recurrent = tensors[:num_linear], tensors[num_linear:2 * num_linear]
        tail = tensors[2 * num_linear:2 * num_linear + 2 * num_kv]
        return Checkpoint(num_tokens, conv, recurrent, list(zip(tail[0::2], tail[1::2])), tensors[-1], last_block_hash)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _payload_bytes(payload) -> int:
    return payload.num_bytes if not isinstance(payload, torch.Tensor) else _tensor_bytes(payload)


def tier_stats(tier: HostTier | None) -> dict:
    """The tier's counters under engine_stats() names (zeros without a tier, so the keys never change)."""
    stats = vars(tier.stats) if tier is not None else vars(TierStats())
    counts = {f"num_tier_{key.removeprefix('num_')}": value for key, value in stats.items() if key.startswith("num_")}
    return {**counts, "tier_pack_seconds": stats["pack_seconds"], "tier_restore_seconds": stats["restore_seconds"],
            "num_tier_entries": len(tier) if tier is not None else 0,
            "num_tier_bytes": tier.num_bytes if tier is not None else 0,
            "num_tier_raw_bytes": tier.num_raw_bytes if tier is not None else 0}
