"""Migrator: a replica's side of moving conversations, between its engine and the StateDepot.

- `leave()`: the replica is being removed (Serve called its destructor after draining its requests): its
  conversations' states, most recently used first, under the byte budget and the deadline, go to the depot.
- `before_turn(request)`: a turn of a conversation this replica does not hold (a retained miss): take its
  state from the depot and import it before the turn is scheduled, so the turn computes only what it added.

Neither can make an answer wrong or fail a request: a depot that is gone, slow or empty, a state lost or
refused, all end in the turn recomputing what it lacks. Counters say which happened.
"""

import asyncio
import logging
import time

from core.app_status import app_deleting
from core.engine_config import MigrationConfig
from core.messages import GenerateRequest
from replicas.cache.conversation_state import StateRefused
from replicas.engine.async_engine import AsyncEngine
from replicas.engine.migration import export_states, import_state

logger = logging.getLogger("ray.serve")


class Migrator:
    def __init__(self, engine: AsyncEngine, config: MigrationConfig, depot=None):
        self.engine = engine
        self.config = config
        self.depot = depot if config.enabled else None  # a DeploymentHandle to the StateDepot, or None
        self.stats = {"num_depot_takes": 0, "num_depot_hits": 0, "num_depot_errors": 0,
                      "num_imported_cached_tokens": 0}

    async def before_turn(self, request: GenerateRequest) -> None:
        key = request.history_key
        engine = self.engine.engine
        if self.depot is None or key is None or request.new_turn_span is None or request.retention == "off" \
                or not engine.retention.enabled or engine.retention.store.holds(key, request.caller):
            return
        self.stats["num_depot_takes"] += 1
        try:
            state = await asyncio.wait_for(self._take(key, request.caller), self.config.take_timeout_s)
        except Exception as exc:  # the depot is gone or slow: this turn recomputes
            self.stats["num_depot_errors"] += 1
            logger.warning("StateDepot take failed (%r): the turn recomputes its history", exc)
            return
        if state is None:
            return
        self.stats["num_depot_hits"] += 1
        try:
            cached = await self.engine.call(lambda e: import_state(e, state))
        except StateRefused as exc:
            logger.warning("a migrated conversation was refused: %s", exc)
            return
        self.stats["num_imported_cached_tokens"] += cached

    async def _take(self, key: str, caller: str):
        return await self.depot.take.remote(key, caller)

    async def leave(self) -> None:
        """Exports every conversation that fits the budget to the depot, within export_timeout_s."""
        if self.depot is None or self.config.export_bytes == 0 or not self.engine.is_healthy:
            return
        if await app_deleting():  # the depot goes with the app: nobody to hand over to
            logger.info("leaving with the app (deleted): no conversations exported")
            return
        start = time.monotonic()
        deadline = start + self.config.export_timeout_s
        try:
            states = await asyncio.wait_for(
                self.engine.call(lambda e: export_states(e, self.config.export_bytes, deadline)),
                self.config.export_timeout_s)
            kept = await asyncio.wait_for(self._put(states), max(0.1, deadline - time.monotonic()))
        except Exception as exc:  # past the deadline, or the depot is gone: the next turns recompute
            logger.warning("exporting conversations failed (%r): their next turns recompute", exc)
            return
        logger.info("exported %d conversation(s) (%d kept by the depot, %.1f MB) in %.2f s", len(states), kept,
                    sum(s.num_bytes for s in states) / 1e6, time.monotonic() - start)

    async def _put(self, states) -> int:
        return await self.depot.put.remote(states) if states else 0
