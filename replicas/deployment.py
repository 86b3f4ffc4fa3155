"""ModelReplica: the Serve deployment that owns one Engine.

Contract of `generate(request)` (called with `handle.options(stream=True)`):
yields GenerateDeltas as core/messages.py describes, each stamped with
this replica's id; raises RequestError before the first delta for a request
that can never run here. When the caller goes away, the generator is closed or
cancelled and the sequence is aborted, its blocks freed at the next step.

Start-up: a model this replica cannot serve raises from the constructor with the
loader's own message (a ValueError, not wrapped), which Serve shows in
`serve status` once it gives up retrying (the builder sets
`max_constructor_retry_count`; serve_app/app.py).
"""

import asyncio
import logging

import psutil

from ray import serve

from core.engine_config import EngineConfig, MigrationConfig
from core.hashing import short_hash
from core.heap import freeze_startup_heap
from core.messages import ChannelTicket, GenerateRequest, RequestError
from core.priority import run_at_normal_priority
from model_files.architectures import check_model_dir
from model_files.prepare import prepare_model
from replicas.cache.host_tier import tier_stats
from replicas.delta_channel import DeltaChannels, Outbox
from replicas.device import resolve_threads
from replicas.engine.async_engine import AsyncEngine
from replicas.engine.engine import Engine
from replicas.metrics import ReplicaMetrics
from replicas.migrator import Migrator

logger = logging.getLogger("ray.serve")

MAX_REPORTED_BLOCKS = 1 << 16  # bounds one report to ~0.6 MB pickled


def node_ip_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return "127.0.0.1"


def current_node_id() -> str:
    """The Ray node this process runs on (hex), "local" outside Ray."""
    import ray

    if not ray.is_initialized():  # get_runtime_context() would start a local Ray
        return "local"
    return ray.get_runtime_context().get_node_id()


def current_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (in-process tests, benchmarks)
        return "local"


class ModelReplica:
    def __init__(self, engine_config: dict, migration: dict | None = None, depot=None):
        """`migration`: MigrationConfig fields; `depot`: a handle to the app's StateDepot (None: nothing moves)."""
        run_at_normal_priority("ModelReplica")  # before the step thread exists: its threads inherit it
        config = EngineConfig(**engine_config)
        # The model may be a spec ('default', a .gguf): prepare it on this node (cached, locked).
        config = config.model_copy(update={"model": str(prepare_model(config.model, progress=False))})
        check_model_dir(config.model)  # the builder checked its node's copy; this node's may differ
        num_threads = resolve_threads(config.num_threads)
        try:
            self.engine = AsyncEngine(lambda: Engine(config), num_threads, config.stream_interval)
        except RuntimeError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValueError):  # a model or config the engine refuses: its message, verbatim
                raise cause from None
            raise
        self._attach(migration, depot)
        logger.info("ModelReplica %s: %s, dtype %s, %d KV blocks, max_model_len %d, %d threads",
                    self.replica_id, config.model, self.engine.engine.dtype,
                    self.engine.engine.block_pool.num_blocks, self.engine.engine.max_model_len, num_threads)
        freeze_startup_heap(f"ModelReplica {self.replica_id}")

    def _attach(self, migration: dict | None, depot) -> None:
        """What serves `self.engine` beyond the engine itself: identity, delta channels, migration, metrics."""
        self.replica_id = current_replica_id()
        self.node_id = current_node_id()
        self.channels = DeltaChannels(self.replica_id, node_ip_address())
        self.migrator = Migrator(self.engine, MigrationConfig(**(migration or {})), depot)
        self.metrics = ReplicaMetrics(self.replica_id)  # a no-op outside Ray
        # Over the requests that came with the router's prediction for this replica.
        self.routing = {"num_routed_requests": 0, "num_predicted_cached_tokens": 0,
                        "num_delivered_cached_tokens": 0, "num_cache_shortfall_tokens": 0}

    async def generate(self, request: GenerateRequest):
        """Deltas on this call, or, when the caller's delta channel is connected here, a ChannelTicket on
        this call and the deltas (and a RequestError, in order) over the channel (replicas/delta_channel.py)."""
        await self.migrator.before_turn(request)  # a conversation that moved here: import it first
        route = await self.channels.outbox_or_offer(request.delta_channel)
        if isinstance(route, Outbox):
            yield ChannelTicket(self.replica_id)
            try:
                async for delta in self._deltas(request):
                    if route.is_closed:  # the caller went away: stop (closing the stream aborts the request)
                        break
                    route.send(request.request_id, delta)
            except RequestError as exc:
                route.send(request.request_id, exc)
            return
        if route is not None:
            yield route  # a ChannelOffer: the caller connects, and its next requests take the channel
        async for delta in self._deltas(request):
            yield delta

    async def _deltas(self, request: GenerateRequest):
        async for delta in self.engine.generate(request):
            delta.replica_id = self.replica_id
            if delta.finish_reason is not None:
                self._record_routing(request, delta.num_cached_tokens)
            yield delta

    def _record_routing(self, request: GenerateRequest, delivered: int) -> None:
        """The router's prediction for this replica vs the cached tokens it delivered: a shortfall is
        a prefix the router believed here that was not (evicted, or its knowledge was stale)."""
        predicted = request.predicted_cached_tokens.get(self.replica_id)
        if predicted is None:
            return
        shortfall = max(0, predicted - delivered)
        for key, value in (("num_routed_requests", 1), ("num_predicted_cached_tokens", predicted),
                           ("num_delivered_cached_tokens", delivered), ("num_cache_shortfall_tokens", shortfall)):
            self.routing[key] += value
        self.metrics.record_routed(predicted, delivered, shortfall)

    def model_info(self) -> dict:
        """Cheap (no engine step): the ingress's `/health` probe and its context-length sync.
        Raises while the engine cannot serve."""
        self.check_health()
        engine = self.engine.engine
        return {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.block_pool.num_blocks,
                "dtype": str(engine.dtype).removeprefix("torch."), "replica_id": self.replica_id}

    def engine_stats(self) -> dict:
        """Counters for operators and tests: tokens computed vs served from cache, blocks in use."""
        engine = self.engine.engine
        pool = engine.block_pool
        return {**vars(engine.stats), "replica_id": self.replica_id, "node_id": self.node_id,
                "num_running": len(engine.scheduler.running), "num_waiting": len(engine.scheduler.waiting),
                "num_free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "num_preemptions": engine.scheduler.num_preemptions, **self.routing, **engine.memory,
                "num_checkpoint_bytes": engine.checkpointer.pool.num_bytes if engine.checkpointer else 0,
                "num_vision_runs": engine.vision.num_runs if engine.vision else 0,
                "num_retained_tokens_kept": engine.retention.store.num_tokens,
                "num_pool_evictions": pool.num_evictions, **tier_stats(engine.host_tier),
                **vars(engine.migration_stats), **self.migrator.stats, **self.channels.stats,
                "num_resident_bytes": psutil.Process().memory_info().rss}

    def recent_steps(self) -> list[tuple[int, float]]:
        """(deltas made, seconds) of the engine's steps since the last call, oldest first (the latest
        STEP_TIMES_KEPT at most); for benchmarks."""
        steps = list(self.engine.step_times)
        self.engine.step_times.clear()
        return steps

    def record_routing_stats(self) -> dict:
        """What this replica holds, for the routers (cache_router/knowledge.py); Serve calls it every
        `request_routing_stats_period_s`. It also exports the replica's metrics.

        -> {"blocks": short hashes of the cached KV blocks (the newest MAX_REPORTED_BLOCKS),
            "tier_blocks": those of the blocks in the host tier (restored on a hit; newest MAX_REPORTED_BLOCKS),
            "conversations": short history keys of the retained conversations, "num_running", "num_waiting"}
        """
        stats = self.engine_stats()
        self.metrics.update(stats)
        engine = self.engine.engine
        blocks = engine.block_pool.cached_hashes()[-MAX_REPORTED_BLOCKS:]
        tier_blocks = engine.host_tier.block_hashes()[-MAX_REPORTED_BLOCKS:] if engine.host_tier else []
        return {"num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                "blocks": [short_hash(h) for h in blocks], "tier_blocks": [short_hash(h) for h in tier_blocks],
                "conversations": [short_hash(k) for k in engine.retention.store.keys()]}

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"engine step loop failed: {self.engine.error!r}")

    def __del__(self):
        """Serve calls this when it removes the replica (scale-in, a rolling update), after draining its
        requests, on the replica's event loop, and awaits what it returns: the conversations' export, then
        the shutdown. Collected outside Serve: just the shutdown."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            engine.shutdown()
            return None
        return self._leave() if getattr(self, "replica_id", "local") != "local" else engine.shutdown()

    async def _leave(self) -> None:
        try:
            await self.migrator.leave()
        finally:
            self.channels.close()
            self.engine.shutdown()

