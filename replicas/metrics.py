"""ReplicaMetrics: one replica's engine state as Ray metrics, tagged `replica=<replica id>`.

Ray's metrics agent exports them on each node's metrics port with a `ray_`
prefix (counters also get `_total`): `ray_tether_replica_kv_blocks_used`,
`ray_tether_replica_generated_tokens_total`, ... (docs/metrics.md).

`ray.util.metrics` needs a Ray worker or driver; outside Ray (in-process tests,
LocalServer, benchmarks) every method is a silent no-op.
"""

import ray

__all__ = ["ReplicaMetrics"]

TAG_KEYS = ("replica",)

# stats key -> (metric name, description); counters get deltas, gauges the value.
COUNTERS = {
    "num_prompt_tokens_computed": ("tether_replica_prompt_tokens_computed",
                                   "Prompt tokens run through the model (recomputation included)."),
    "num_prompt_tokens_cached": ("tether_replica_prompt_tokens_cached",
                                 "Prompt tokens served from the prefix cache instead of computed."),
    "num_generated_tokens": ("tether_replica_generated_tokens", "Tokens generated."),
    "num_preemptions": ("tether_replica_preemptions", "Sequences preempted for lack of KV blocks."),
    "num_pool_evictions": ("tether_replica_kv_block_evictions", "Cached KV blocks evicted from the pool (reused)."),
    "num_tier_blocks_stored": ("tether_replica_tier_blocks_stored", "Evicted KV blocks the host tier took."),
    "num_tier_blocks_restored": ("tether_replica_tier_blocks_restored",
                                 "KV blocks brought back from the host tier into the pool (tier hits)."),
    "num_tier_blocks_dropped": ("tether_replica_tier_blocks_dropped",
                                "Evicted KV blocks the host tier refused or later dropped (gone for good)."),
    "num_tier_checkpoints_stored": ("tether_replica_tier_checkpoints_stored",
                                    "Evicted recurrent-state checkpoints the host tier took (hybrid models)."),
    "num_tier_checkpoints_restored": ("tether_replica_tier_checkpoints_restored",
                                      "Checkpoints brought back from the host tier (hybrid models)."),
    "num_tier_checkpoints_dropped": ("tether_replica_tier_checkpoints_dropped",
                                     "Checkpoints the host tier refused or later dropped (hybrid models)."),
    "num_states_imported": ("tether_replica_states_imported",
                            "Conversations imported from the StateDepot (moved here from a replica that left)."),
    "num_imports_refused": ("tether_replica_state_imports_refused",
                            "Migrated states refused: another model, dtype, kernel path or layout, or inconsistent."),
    "num_depot_errors": ("tether_replica_depot_errors",
                         "Depot takes that failed or timed out (the turn recomputed its history)."),
}
# Per routed request (one that carried the router's prediction for this replica).
ROUTED = {
    "predicted": ("tether_replica_predicted_cached_tokens",
                  "Prompt tokens the router predicted this replica serves from cache."),
    "delivered": ("tether_replica_delivered_cached_tokens",
                  "Prompt tokens this replica served from cache, for requests that came with a prediction."),
    "shortfall": ("tether_replica_cache_shortfall_tokens",
                  "Predicted cached tokens that were not there (evicted, or the router's knowledge was stale)."),
}
GAUGES = {
    "num_running": ("tether_replica_running_sequences", "Sequences in the running batch."),
    "num_waiting": ("tether_replica_waiting_sequences", "Sequences waiting to be scheduled."),
    "num_blocks_used": ("tether_replica_kv_blocks_used", "KV cache blocks in use."),
    "num_blocks": ("tether_replica_kv_blocks_capacity", "KV cache blocks in the pool."),
    "num_resident_bytes": ("tether_replica_resident_bytes", "Resident memory (RSS) of the replica's process."),
    "num_weight_bytes": ("tether_replica_weight_bytes", "Bytes of the model's weights and buffers."),
    "num_kv_cache_bytes": ("tether_replica_kv_cache_bytes", "Bytes of the paged KV pool (engine.kv_cache_bytes)."),
    "num_checkpoint_bytes": ("tether_replica_checkpoint_bytes",
                             "Bytes of saved recurrent-state checkpoints (hybrid models; engine.checkpoint_bytes)."),
    "num_tier_bytes": ("tether_replica_tier_bytes", "Bytes the host tier holds, packed (engine.host_tier_bytes)."),
    "num_tier_raw_bytes": ("tether_replica_tier_raw_bytes", "What the host tier holds, in bytes before packing."),
    "num_retained_tokens_kept": ("tether_replica_retained_tokens",
                                 "Token ids kept for retained conversations (engine.max_retained_tokens)."),
}


class ReplicaMetrics:
    """Feed it `ModelReplica.engine_stats()` periodically; it turns cumulative counts into counter deltas.

    Contract: `update` never raises for a stats dict with missing keys (they read as 0), and a count that
    went down (an engine restarted under the same id) is taken as counting again from zero.
    """

    def __init__(self, replica_id: str):
        self.replica_id = replica_id
        self.is_enabled = ray.is_initialized()
        self._last: dict[str, int] = {key: 0 for key in COUNTERS}
        self._counters = {}
        self._routed = {}
        self._gauges = {}
        if not self.is_enabled:
            return
        from ray.util.metrics import Counter, Gauge

        tags = {"replica": replica_id}
        for key, (name, description) in COUNTERS.items():
            self._counters[key] = Counter(name, description, tag_keys=TAG_KEYS).set_default_tags(tags)
        for key, (name, description) in ROUTED.items():
            self._routed[key] = Counter(name, description, tag_keys=TAG_KEYS).set_default_tags(tags)
        for key, (name, description) in GAUGES.items():
            self._gauges[key] = Gauge(name, description, tag_keys=TAG_KEYS).set_default_tags(tags)

    def record_routed(self, predicted: int, delivered: int, shortfall: int) -> None:
        """One finished request that came with the router's prediction for this replica."""
        if not self.is_enabled:
            return
        for key, value in (("predicted", predicted), ("delivered", delivered), ("shortfall", shortfall)):
            if value > 0:  # Ray's Counter.inc rejects 0
                self._routed[key].inc(value)

    def update(self, stats: dict) -> None:
        if not self.is_enabled:
            return
        values = dict(stats)
        values["num_blocks_used"] = int(stats.get("num_blocks", 0)) - int(stats.get("num_free_blocks", 0))
        for key, counter in self._counters.items():
            value = int(values.get(key, 0))
            last = self._last[key]
            delta = value - last if value >= last else value
            self._last[key] = value
            if delta > 0:  # Ray's Counter.inc rejects 0
                counter.inc(delta)
        for key, gauge in self._gauges.items():
            gauge.set(int(values.get(key, 0)))
