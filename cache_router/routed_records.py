"""RoutedRecords: what this router sent where (blocks, or route keys), believed for `ttl_s`.

Per replica an LRU of key -> time recorded, bounded to its `max_entries` most recent; entries older than
`ttl_s` no longer count, and leave the LRU as new ones come in. Across replicas, key -> the mask of the
replicas with an entry for it (`ReplicaSlots` bits), so a lookup asks only those.
"""

from collections import OrderedDict

_NONE: dict = {}  # the entries of a replica without any


class RoutedRecords:
    def __init__(self, max_entries: int, ttl_s: float):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._times: dict[int, OrderedDict] = {}  # bit -> key -> time recorded, oldest first
        self._holders: dict = {}  # key -> mask of the replicas with an entry

    def add(self, bit: int, keys, now: float) -> None:
        times = self._times.get(bit)
        if times is None:
            times = self._times[bit] = OrderedDict()
        for key in keys:
            if key in times:
                times.move_to_end(key)
            else:
                mask = self._holders.get(key)
                self._holders[key] = bit if mask is None else mask | bit
            times[key] = now
        while times and (len(times) > self.max_entries or now - next(iter(times.values())) > self.ttl_s):
            self._unset(times.popitem(last=False)[0], bit)

    def fresh(self, key, among: int, now: float) -> int:
        """The mask of the replicas in `among` with an entry for `key` recorded within `ttl_s`."""
        candidates = self._holders.get(key, 0) & among
        fresh = 0
        while candidates:
            bit = candidates & -candidates  # the lowest set bit
            if self.is_fresh(bit, key, now):
                fresh |= bit
            candidates ^= bit
        return fresh

    def is_fresh(self, bit: int, key, now: float) -> bool:
        """Whether that replica has an entry for `key` recorded within `ttl_s`."""
        recorded = self._times.get(bit, _NONE).get(key)
        return recorded is not None and now - recorded <= self.ttl_s

    def forget(self, bit: int) -> None:
        for key in self._times.pop(bit, ()):
            self._unset(key, bit)

    def _unset(self, key, bit: int) -> None:
        mask = self._holders[key] & ~bit
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]
