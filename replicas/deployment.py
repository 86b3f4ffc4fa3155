"""ModelReplica: the Serve deployment that owns one Engine.

Contract of `generate(request)` (called with `handle.options(stream=True)`):
yields GenerateDeltas as replicas/messages.py describes, each stamped with
this replica's id; raises RequestError before the first delta for a request
that can never run here. When the caller goes away, the generator is closed or
cancelled and the sequence is aborted, its blocks freed at the next step.
"""

import logging

from ray import serve

from replicas.config import EngineConfig
from replicas.device import set_threads
from replicas.engine.async_engine import AsyncEngine
from replicas.engine.engine import Engine
from replicas.messages import GenerateRequest
from replicas.metrics import ReplicaMetrics
from replicas.models.prepare import prepare_model

logger = logging.getLogger("ray.serve")


def current_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (in-process tests, benchmarks)
        return "local"


class ModelReplica:
    def __init__(self, engine_config: dict):
        config = EngineConfig(**engine_config)
        # The model may be a spec ('default', a .gguf): prepare it on this node (cached, locked).
        config = config.model_copy(update={"model": str(prepare_model(config.model, progress=False))})
        num_threads = set_threads(config.num_threads)
        self.engine = AsyncEngine(Engine(config))
        self.replica_id = current_replica_id()
        self.metrics = ReplicaMetrics(self.replica_id)  # a no-op outside Ray
        logger.info("ModelReplica %s: %s, dtype %s, %d KV blocks, max_model_len %d, %d threads",
                    self.replica_id, config.model, self.engine.engine.dtype,
                    self.engine.engine.block_pool.num_blocks, self.engine.engine.max_model_len, num_threads)

    async def generate(self, request: GenerateRequest):
        async for delta in self.engine.generate(request):
            delta.replica_id = self.replica_id
            yield delta

    def model_info(self) -> dict:
        engine = self.engine.engine
        return {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.block_pool.num_blocks,
                "dtype": str(engine.dtype).removeprefix("torch."), "replica_id": self.replica_id}

    def engine_stats(self) -> dict:
        """Counters for operators and tests: tokens computed vs served from cache, blocks in use."""
        engine = self.engine.engine
        pool = engine.block_pool
        return {**vars(engine.stats), "replica_id": self.replica_id,
                "num_running": len(engine.scheduler.running), "num_waiting": len(engine.scheduler.waiting),
                "num_free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "num_preemptions": engine.scheduler.num_preemptions}

    def record_routing_stats(self) -> dict:
        """Serve calls this every `request_routing_stats_period_s`; it also exports the replica's metrics."""
        stats = self.engine_stats()
        self.metrics.update(stats)
        return {"num_running": stats["num_running"], "num_waiting": stats["num_waiting"]}

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"engine step loop failed: {self.engine.error!r}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

