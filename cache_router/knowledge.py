"""CacheKnowledge: what one router believes each replica holds, from the replicas' reports and its own routing.

Two sources, merged per replica:
- reports: `ModelReplica.record_routing_stats()` returns `{"blocks": [...], "tier_blocks": [...],
  "conversations": [...]}` (short hashes of the KV blocks in the pool and in the replica's host tier,
  which restores them on a hit, so both count as held; and of the retained conversations' history keys); the
  router reads it from `RunningReplica.routing_stats` about one report period late, and a new
  report replaces the previous one;
- its own routing: a request sent to a replica records the prompt's blocks and its route key
  there, believed for `ttl_s` (by then a report shows them, or they were evicted).
And, across replicas: which blocks several route keys have sent (a shared system prompt).
Every table is bounded to its `max_entries` most recent entries.
"""

import time
from collections import OrderedDict

_SHARED = ""  # the value of a block seen under two route keys


class _Recent:
    """An LRU of key -> time recorded, bounded, with an age limit on reads."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._times: OrderedDict = OrderedDict()

    def add(self, key, now: float) -> None:
        self._times[key] = now
        self._times.move_to_end(key)
        while len(self._times) > self.max_entries:
            self._times.popitem(last=False)

    def fresh(self, key, now: float, ttl_s: float) -> bool:
        recorded = self._times.get(key)
        return recorded is not None and now - recorded <= ttl_s


class _ReplicaView:
    def __init__(self, max_entries: int):
        self.report: dict | None = None  # the report the sets below were built from
        self.blocks: frozenset[int] = frozenset()  # in the KV pool or in the host tier
        self.conversations: frozenset[int] = frozenset()
        self.routed_blocks = _Recent(max_entries)
        self.routed_keys = _Recent(max_entries)


class CacheKnowledge:
    def __init__(self, ttl_s: float = 15.0, max_entries: int = 65536):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._replicas: dict[str, _ReplicaView] = {}
        self._block_keys: OrderedDict[int, str] = OrderedDict()  # block -> its route key, or _SHARED

    def _view(self, replica_id: str) -> _ReplicaView:
        view = self._replicas.get(replica_id)
        if view is None:
            view = self._replicas[replica_id] = _ReplicaView(self.max_entries)
        return view

    def observe_report(self, replica_id: str, report: dict | None) -> None:
        """Takes a replica's latest routing stats (cheap when it is the one already seen)."""
        view = self._view(replica_id)
        if not report or report is view.report:
            return
        view.report = report
        view.blocks = frozenset(report.get("blocks", ())) | frozenset(report.get("tier_blocks", ()))
        view.conversations = frozenset(report.get("conversations", ()))

    def record_routed(self, replica_id: str, route_key: str | None, blocks: list[int],
                      now: float | None = None) -> None:
        """A request with these prompt blocks (short hashes) went to `replica_id`."""
        now = time.monotonic() if now is None else now
        view = self._view(replica_id)
        for block in blocks:
            view.routed_blocks.add(block, now)
        if route_key is None:
            return
        view.routed_keys.add(route_key, now)
        for block in blocks:
            seen = self._block_keys.get(block)
            self._block_keys[block] = route_key if seen in (None, route_key) else _SHARED
            self._block_keys.move_to_end(block)
        while len(self._block_keys) > self.max_entries:
            self._block_keys.popitem(last=False)

    def holds_conversation(self, replica_id: str, history: int | None, route_key: str | None,
                           now: float | None = None) -> bool:
        """Reported holding the history key, or sent this route key within `ttl_s`."""
        now = time.monotonic() if now is None else now
        view = self._view(replica_id)
        if history is not None and history in view.conversations:
            return True
        return route_key is not None and view.routed_keys.fresh(route_key, now, self.ttl_s)

    def matched_blocks(self, replica_id: str, blocks: list[int], now: float | None = None) -> int:
        """How many leading blocks the replica holds (reported, or sent there within `ttl_s`)."""
        now = time.monotonic() if now is None else now
        view = self._view(replica_id)
        count = 0
        for block in blocks:
            if block not in view.blocks and not view.routed_blocks.fresh(block, now, self.ttl_s):
                break
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
        """Forgets replicas that are gone."""
        for replica_id in set(self._replicas) - set(replica_ids):
            del self._replicas[replica_id]
