"""RetainedStore: the exact token ids of finished chat turns, found by the history key of the next turn.

A finished turn is stored under the key the client's next request will produce
(core.hashing.history_key of its messages + the assistant reply it
received). Entries are namespaced by the caller (the key digests the caller
too, and the entry is checked against it). Bounded: least recently used
entries go first once the stored ids exceed `max_tokens`; an evicted
conversation costs a re-prefill, never an error. The KV of these ids lives in
the prefix cache, found by block hash, and is evicted by the block pool's LRU.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class RetainedConversation:
    caller: str
    token_ids: list[int]


class RetainedStore:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, RetainedConversation] = OrderedDict()
        self.num_tokens = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """A snapshot of the stored history keys, least recently used first."""
        return list(self._entries)

    def items(self) -> list[tuple[str, RetainedConversation]]:
        """A snapshot of (history key, entry), least recently used first."""
        return list(self._entries.items())

    def holds(self, key: str, caller: str) -> bool:
        """Whether `get` would find it; leaves the order as it is (safe to ask from another thread)."""
        entry = self._entries.get(key)
        return entry is not None and entry.caller == caller

    def get(self, key: str, caller: str) -> list[int] | None:
        entry = self._entries.get(key)
        if entry is None or entry.caller != caller:
            return None
        self._entries.move_to_end(key)
        return entry.token_ids

    def put(self, key: str, caller: str, token_ids: list[int]) -> None:
        if len(token_ids) > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_tokens -= len(old.token_ids)
        self._entries[key] = RetainedConversation(caller, list(token_ids))
        self.num_tokens += len(token_ids)
        while self.num_tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.num_tokens -= len(evicted.token_ids)
            self.num_evictions += 1
