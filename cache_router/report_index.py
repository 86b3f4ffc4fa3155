"""ReportIndex: the replicas' latest reports, inverted: a block or a conversation -> the mask of the replicas
whose report holds it (`ReplicaSlots` bits).

A report is `ModelReplica.record_routing_stats()`'s: short hashes of the blocks in the KV pool ("blocks") and
in the host tier ("tier_blocks"; both count as held) and of the retained conversations' history keys
("conversations"). A new report replaces the replica's previous one; the index changes by their difference
(computed in C loops: one frozenset of the new lists, probed by the old), so a steady cache costs little per
report and an unchanged list nothing. The reports themselves stay Serve's (`RunningReplica.routing_stats`):
the index keeps the last one it took per replica, to diff the next against. Its size is the reports': each
replica reports at most MAX_REPORTED_BLOCKS blocks of each kind (replicas/deployment.py).

Inverted rather than a frozenset per replica: a decision reads one entry per prompt block instead of probing
every replica's set (at 256 replicas, 256 cache misses per block), and an int-only dict is no work for the
garbage collector. bench/router_sim.py measures both sides of that trade (decisions, taking in reports).
"""

from itertools import chain, filterfalse

_BLOCK_LISTS, _CONVERSATION_LISTS = ("blocks", "tier_blocks"), ("conversations",)


class ReportIndex:
    def __init__(self):
        self.blocks: dict[int, int] = {}  # block -> mask of the replicas holding it
        self.conversations: dict[int, int] = {}  # history key -> mask of the replicas holding it
        self._taken: dict[int, dict] = {}  # bit -> the replica's report the index holds

    def take(self, bit: int, report: dict | None) -> None:
        """The replica's latest report (an empty one, as before the first period, changes nothing)."""
        if not report or self._taken.get(bit) is report:
            return
        self._replace(bit, report)

    def forget(self, bit: int) -> None:
        self._replace(bit, {})

    def _replace(self, bit: int, report: dict) -> None:
        old = self._taken.pop(bit, None) or {}
        for table, names in ((self.blocks, _BLOCK_LISTS), (self.conversations, _CONVERSATION_LISTS)):
            old_lists, new_lists = [old.get(n) or () for n in names], [report.get(n) or () for n in names]
            if old_lists != new_lists:
                _update(table, bit, chain(*old_lists), frozenset(chain(*new_lists)))
        if report:
            self._taken[bit] = report


def _update(table: dict, bit: int, old, new: frozenset) -> None:
    """Clears `bit` from the keys of `old` (an iterable) not in `new` and sets it on those of `new` not in `old`.
    The bulk runs in C loops (filterfalse, map, difference, dict.fromkeys, update): a report lists tens of
    thousands of blocks."""
    old = list(old)
    removed = list(set(filterfalse(new.__contains__, old)))
    masks = list(map(table.pop, removed))
    table.update((key, mask ^ bit) for key, mask in zip(removed, masks) if mask != bit)  # other holders stay
    added = new.difference(old)
    also_held = added & table.keys()  # by other replicas too (a shared system prompt)
    for key in also_held:
        table[key] |= bit
    table.update(dict.fromkeys(added - also_held, bit))  # held here alone: the slot's one int, shared
