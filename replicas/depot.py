"""StateDepot: the Serve deployment that holds conversations' states between a replica that leaves and the
replica that takes their next turn.

An object a replica `ray.put`s is lost when that replica exits, so a leaving replica hands its states to
this long-lived deployment (one replica, part of the app; a ModelReplica scale-in or rolling update does
not restart it), which keeps them in its own memory. The replica the router chooses for a conversation's
next turn takes the state (by history key and caller) and imports it; a state is taken once.

Contract:
- `take` never returns a state to another caller than the one it was exported for (and leaves it);
- bounded: at most `max_bytes` held (oldest dropped first), each state at most `ttl_s`;
- losing the depot (or a state in it) costs recomputation only: a miss re-prefills.

When the app itself rolls (a changed `args` gives every deployment a new version), the leaving depot hands
its states to its successor through its own deployment's handle (Serve no longer routes to a leaving
replica), bounded by HANDOFF_TIMEOUT_S; with no successor (the app deleted) they are dropped.
"""

import asyncio
import logging
import time
from collections import OrderedDict

from replicas.cache.conversation_state import ConversationState

logger = logging.getLogger("ray.serve")
HANDOFF_TIMEOUT_S = 5.0


class StateDepot:
    def __init__(self, max_bytes: int = 2 << 30, ttl_s: float = 600.0):
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._states: OrderedDict[int, tuple[float, ConversationState]] = OrderedDict()  # oldest first
        self._by_key: dict[str, int] = {}  # history key -> state id
        self._next_id = 0
        self.num_bytes = 0
        self.stats = {"num_states_received": 0, "num_states_taken": 0, "num_states_dropped": 0,
                      "num_takes_missed": 0, "num_takes_refused": 0}

    def put(self, states: list[ConversationState]) -> int:
        """Keeps `states` (a later state for a history key replaces the earlier). -> how many were kept."""
        kept = 0
        for state in states:
            if state.num_bytes > self.max_bytes:
                self.stats["num_states_dropped"] += 1
                continue
            for key in state.history_keys:
                self._drop(self._by_key.get(key))
            state_id, self._next_id = self._next_id, self._next_id + 1
            self._states[state_id] = (time.monotonic(), state)
            self._by_key.update((key, state_id) for key in state.history_keys)
            self.num_bytes += state.num_bytes
            kept += 1
        self.stats["num_states_received"] += kept
        self._bound()
        return kept

    def take(self, history_key: str, caller: str) -> ConversationState | None:
        """The state exported for this conversation, removed from the depot; None if there is none (or it is
        another caller's: that one stays)."""
        self._bound()
        state_id = self._by_key.get(history_key)
        if state_id is None:
            self.stats["num_takes_missed"] += 1
            return None
        state = self._states[state_id][1]
        if state.caller != caller:
            self.stats["num_takes_refused"] += 1
            return None
        self._drop(state_id, dropped=False)
        self.stats["num_states_taken"] += 1
        return state

    def __del__(self):
        """Serve removes this replica: the states go to the depot that replaces it (see the module doc)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None  # collected outside Serve
        return self._hand_off() if self._states else None

    async def _hand_off(self) -> None:
        from ray import serve

        states = [state for _, state in self._states.values()]
        try:
            context = serve.get_replica_context()
            successor = serve.get_deployment_handle(context.deployment, app_name=context.app_name)
            kept = await asyncio.wait_for(successor.put.remote(states), HANDOFF_TIMEOUT_S)
            logger.info("StateDepot: handed %d state(s) to its successor, %d kept", len(states), kept)
        except Exception as exc:  # no successor: the next turns recompute
            logger.warning("StateDepot: %d state(s) dropped on leaving (%r)", len(states), exc)

    def depot_stats(self) -> dict:
        return {**self.stats, "num_states": len(self._states), "num_bytes": self.num_bytes}

    def _bound(self) -> None:
        """Drops states past their age, then the oldest past the byte budget."""
        now = time.monotonic()
        while self._states:
            state_id, (stored, _) = next(iter(self._states.items()))
            if self.num_bytes <= self.max_bytes and now - stored <= self.ttl_s:
                return
            self._drop(state_id)

    def _drop(self, state_id: int | None, dropped: bool = True) -> None:
        if state_id is None or state_id not in self._states:
            return
        _, state = self._states.pop(state_id)
        for key in state.history_keys:
            if self._by_key.get(key) == state_id:
                del self._by_key[key]
        self.num_bytes -= state.num_bytes
        if dropped:
            self.stats["num_states_dropped"] += 1
