"""CacheKnowledge: what one router believes each replica holds, from the replicas' reports and its own routing.

Two sources, merged per replica:
- reports: `ModelReplica.record_routing_stats()` returns `{"blocks": [...], "tier_blocks": [...],
  "conversations": [...]}` (short hashes of the KV blocks in the pool and in the replica's host tier,
  which restores them on a hit, so both count as held; and of the retained conversations' history keys); the
  router reads it from `RunningReplica.routing_stats` about one report period late, and a new
  report replaces the previous one (`ReportIndex`);
- its own routing: a request sent to a replica records the prompt's blocks and its route key
  there, believed for `ttl_s` (by then a report shows them, or they were evicted) (`RoutedRecords`).
And, across replicas: which blocks several route keys have sent (a shared system prompt).
Every table is inverted (a block or a key -> the mask of the replicas holding it, `ReplicaSlots`), so a
question about one request reads one entry per block, never one per replica. The router's own tables are
bounded to their `max_entries` most recent entries (per replica), the reports' by the replicas.
"""

import time
from collections import OrderedDict

from cache_router.report_index import ReportIndex
from cache_router.routed_records import RoutedRecords
from cache_router.slots import ReplicaSlots

_SHARED = ""  # the value of a block seen under two route keys


class CacheKnowledge:
    def __init__(self, ttl_s: float = 15.0, max_entries: int = 65536):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._slots = ReplicaSlots()
        self._reports = ReportIndex()
        self._routed_blocks = RoutedRecords(max_entries, ttl_s)
        self._routed_keys = RoutedRecords(max_entries, ttl_s)
        self._block_keys: OrderedDict[int, str] = OrderedDict()  # block -> its route key, or _SHARED

    def live(self, replica_ids) -> int:
        """The mask of these replicas, the `live` argument of the questions below."""
        return self._slots.mask(replica_ids)

    def observe_report(self, replica_id: str, report: dict | None) -> None:
        """Takes a replica's latest routing stats (cheap when it is the one already seen)."""
        self._reports.take(self._slots.bit(replica_id), report)

    def record_routed(self, replica_id: str, route_key: str | None, blocks: list[int],
                      now: float | None = None) -> None:
        """A request with these prompt blocks (short hashes) went to `replica_id`."""
        now = time.monotonic() if now is None else now
        bit = self._slots.bit(replica_id)
        self._routed_blocks.add(bit, blocks, now)
        if route_key is None:
            return
        self._routed_keys.add(bit, (route_key,), now)
        for block in blocks:
            seen = self._block_keys.get(block)
            self._block_keys[block] = route_key if seen in (None, route_key) else _SHARED
            self._block_keys.move_to_end(block)
        while len(self._block_keys) > self.max_entries:
            self._block_keys.popitem(last=False)

    def conversation_holders(self, live: int, history: int | None, route_key: str | None,
                             now: float | None = None) -> list[str]:
        """The live replicas that reported the history key, or were sent this route key within `ttl_s`."""
        now = time.monotonic() if now is None else now
        held = self._reports.conversations.get(history, 0) & live if history is not None else 0
        if route_key is not None:
            held |= self._routed_keys.fresh(route_key, live & ~held, now)
        return self._slots.ids(held)

    def matched_blocks(self, live: int, blocks: list[int], now: float | None = None) -> dict[int, list[str]]:
        """Leading blocks held -> the live replicas holding exactly that many of `blocks` (reported, or sent
        there within `ttl_s`); replicas holding none are left out. Walks the blocks while any replica matches:
        one mask per block while several do (a shared system prompt), then the last one's own run."""
        now = time.monotonic() if now is None else now
        by_count: dict[int, list[str]] = {}
        matching, count = live, 0  # `matching` hold blocks[:count]
        while matching & (matching - 1) and count < len(blocks):  # two replicas or more
            block = blocks[count]
            held = self._reports.blocks.get(block, 0) & matching
            if held != matching:
                held |= self._routed_blocks.fresh(block, matching & ~held, now)
                if count and held != matching:
                    by_count[count] = self._slots.ids(matching & ~held)
                matching = held
            count += 1
        if matching and count < len(blocks):  # one replica left
            count = self._held_run(matching, blocks, count, now)
        if matching and count:
            by_count[count] = self._slots.ids(matching)
        return by_count

    def _held_run(self, bit: int, blocks: list[int], start: int, now: float) -> int:
        """Where the run of blocks from `start` that one replica holds ends (its own routing checked first:
        a conversation that comes back within `ttl_s`)."""
        reported, is_fresh, count = self._reports.blocks, self._routed_blocks.is_fresh, start
        while count < len(blocks) and (is_fresh(bit, blocks[count], now) or reported.get(blocks[count], 0) & bit):
            count += 1
        return count

    def shared_blocks(self, blocks: list[int]) -> int:
        """How many leading blocks were sent under more than one route key."""
        count = 0
        for block in blocks:
            if self._block_keys.get(block) != _SHARED:
                break
            count += 1
        return count

    def retain_only(self, replica_ids) -> None:
        """Forgets replicas that are gone (their bits leave every table before their slots are reused)."""
        for replica_id in set(self._slots.known()) - set(replica_ids):
            bit = self._slots.bit(replica_id)
            self._reports.forget(bit)
            self._routed_blocks.forget(bit)
            self._routed_keys.forget(bit)
            self._slots.release(replica_id)
