"""CheckpointPool: saved recurrent states of hybrid models, at exact token boundaries.

A checkpoint summarises exactly the first `num_tokens` ids of a sequence and is keyed by
core.hashing.prefix_hash of those ids: it is used only when a request's leading ids are
exactly them. It carries what the linear layers cannot recompute, and what the first token needs:

    conv / recurrent state per linear layer     the state after num_tokens tokens
    tail_kv per full-attention layer            K, V of the partial last block (num_tokens % block_size rows);
                                                full blocks stay in the prefix cache, found by block hash
    hidden                                      the final hidden row at position num_tokens - 1, so a
                                                prompt that is all checkpoint still gets its first logits

Bounded: least recently used checkpoints go first past `max_bytes`; an evicted one costs a
re-prefill, never a wrong token, and goes to `on_evict(key, checkpoint)` when set (the host tier's).
Contract: `lookup` never modifies a checkpoint.
"""

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.hashing import prefix_hash


@dataclass(slots=True)
class Checkpoint:
    num_tokens: int
    conv_states: list[torch.Tensor]  # per linear layer: [conv_dim, W - 1]
    recurrent_states: list[torch.Tensor]  # per linear layer: [HV, K, V] float32
    tail_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per full-attention layer: [num_tokens % bs, Hkv, D]
    hidden: torch.Tensor  # [hidden]
    last_block_hash: bytes | None = None  # the last full block of its prefix: the host tier values it as that block

    @property
    def num_bytes(self) -> int:
        tensors = [*self.conv_states, *self.recurrent_states, *(t for kv in self.tail_kv for t in kv), self.hidden]
        return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointPool:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # how many checkpoints end at each length
        self.num_bytes = 0
        self.num_saves = 0
        self.num_hits = 0
        self.num_evictions = 0
        self.on_evict: Callable[[bytes, "Checkpoint"], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def has(self, token_ids: list[int]) -> bool:
        return prefix_hash(token_ids) in self._entries

    def save(self, token_ids: list[int], checkpoint: Checkpoint) -> None:
        if self.put(prefix_hash(token_ids), checkpoint):
            self.num_saves += 1

    def put(self, key: bytes, checkpoint: Checkpoint) -> bool:
        """Holds `checkpoint` under its prefix hash (a save, or one back from the host tier). -> held."""
        if key in self._entries or checkpoint.num_bytes > self.max_bytes:
            return False
        self._entries[key] = checkpoint
        self._lengths[checkpoint.num_tokens] += 1
        self.num_bytes += checkpoint.num_bytes
        while self.num_bytes > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self._forget(evicted)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(evicted_key, evicted)
        return key in self._entries

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[Checkpoint]:
        """Checkpoints of leading parts of `token_ids` no longer than `max_tokens`, longest first."""
        found = []
        for length in sorted((n for n in self._lengths if n <= max_tokens), reverse=True):
            checkpoint = self._entries.get(prefix_hash(token_ids[:length]))
            if checkpoint is not None:
                found.append(checkpoint)
        return found

    def touch(self, token_ids: list[int]) -> None:
        self._entries.move_to_end(prefix_hash(token_ids))
        self.num_hits += 1

    def _forget(self, checkpoint: Checkpoint) -> None:
        self.num_bytes -= checkpoint.num_bytes
        self._lengths[checkpoint.num_tokens] -= 1
        if not self._lengths[checkpoint.num_tokens]:
            del self._lengths[checkpoint.num_tokens]
