"""StateSlotPool: the recurrent-state slots of a hybrid model, one per running sequence.

A slot indexes every linear layer's conv and recurrent state tensors (replicas/models/gated_deltanet.py).
A running sequence owns one from admission to finish or preemption; a freed slot is reused as is:
the next owner starts with `has_initial_state` False, which ignores what the slot holds.
"""


class StateSlotPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot: more running sequences than max_num_seqs")
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)
