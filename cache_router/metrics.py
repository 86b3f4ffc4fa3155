"""RouterMetrics: what each router decided, as Ray metrics tagged with the chosen replica.

Exported by the process the router runs in (the ingress replica) on the node's
Ray metrics port, prefixed `ray_` with counters ending `_total`:
- `tether_router_requests{replica, reason}`: requests routed, by policy step
  (conversation, prefix, rendezvous, balance, waited, load);
- `tether_router_predicted_cached_tokens{replica}`: prompt tokens the router expected
  the chosen replica to serve from cache (the replica reports what it delivered);
- `tether_router_forgone_cached_tokens{replica}`: tokens another replica was expected
  to hold beyond the chosen one: cache given up for load, a routing miss by choice.
Outside a Ray process every method is a no-op.
"""

import ray

__all__ = ["RouterMetrics"]


class RouterMetrics:
    def __init__(self):
        self.is_enabled = ray.is_initialized()
        if not self.is_enabled:
            return
        from ray.util.metrics import Counter

        self._requests = Counter("tether_router_requests", "Requests routed, by chosen replica and policy step.",
                                 tag_keys=("replica", "reason"))
        self._predicted = Counter("tether_router_predicted_cached_tokens",
                                  "Prompt tokens the router predicted the chosen replica serves from cache.",
                                  tag_keys=("replica",))
        self._forgone = Counter("tether_router_forgone_cached_tokens",
                                "Cached tokens predicted on another replica beyond the chosen one's.",
                                tag_keys=("replica",))

    def record(self, replica_id: str, reason: str, predicted: int, best_elsewhere: int) -> None:
        if not self.is_enabled:
            return
        tags = {"replica": replica_id}
        self._requests.inc(1, tags={**tags, "reason": reason})
        if predicted > 0:  # Ray's Counter.inc rejects 0
            self._predicted.inc(predicted, tags=tags)
        if best_elsewhere > predicted:
            self._forgone.inc(best_elsewhere - predicted, tags=tags)
