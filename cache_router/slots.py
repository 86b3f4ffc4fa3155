"""ReplicaSlots: one bit per known replica, so that "which replicas hold X" is one int (a mask).

The knowledge's inverted tables map a block or a conversation to the mask of the replicas holding it; a
decision intersects masks instead of asking every replica. A slot freed by a replica that is gone is reused:
the tables must have cleared its bit first (`CacheKnowledge.retain_only` does).
"""

from itertools import compress


class ReplicaSlots:
    def __init__(self):
        self._ids: list[str | None] = []  # slot -> replica id (None: free)
        self._bits: dict[str, int] = {}  # replica id -> 1 << slot; the same int object in every table
        self._free: list[int] = []

    def bit(self, replica_id: str) -> int:
        """The replica's bit, given a slot on first sight."""
        bit = self._bits.get(replica_id)
        if bit is None:
            slot = self._free.pop() if self._free else len(self._ids)
            if slot == len(self._ids):
                self._ids.append(None)
            self._ids[slot] = replica_id
            bit = self._bits[replica_id] = 1 << slot
        return bit

    def mask(self, replica_ids) -> int:
        mask = 0
        for replica_id in replica_ids:
            mask |= self.bit(replica_id)
        return mask

    def ids(self, mask: int) -> list[str]:
        """The replica ids of the bits set in `mask`, lowest slot first."""
        # bin() writes the highest bit first: reversed, character i is slot i (the "0b" falls past the last set bit)
        return list(compress(self._ids, map("1".__eq__, reversed(bin(mask)))))

    def known(self) -> list[str]:
        return list(self._bits)

    def release(self, replica_id: str) -> None:
        slot = self._bits.pop(replica_id).bit_length() - 1
        self._ids[slot] = None
        self._free.append(slot)
