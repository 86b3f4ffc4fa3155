"""ConversationRouter: the Ray Serve request router that tethers a conversation to a replica.

Contract (runs inside each caller's process, on the handle's event loop; never blocks):
- The key is `route_key` of the `GenerateRequest` passed to the replica method (first
  positional arg or any kwarg), else the handle's `session_id` option.
- With a key, the only choice is the rendezvous owner among the live replicas:
  deterministic, so two ingress replicas agree without sharing state, and sticky
  across turns. A slow queue-length probe never moves a key (the framework retries
  the owner with a longer deadline); the request spills to the least loaded replica
  only when the owner is known full, its known queue exceeds the least loaded one's
  by more than `imbalance_threshold`, or the request has waited `max_wait_s`.
- Without a key: the least loaded replica (the framework picks the lowest cached
  queue length within the rank we return; shuffled so ties spread).
- Fan-out: each pending request gets the replica chosen for it, also when several
  share one `internal_request_id` (see `_fulfill_next_pending_request`).

Configure with `RequestRouterConfig(request_router_class=ConversationRouter,
request_router_kwargs={"imbalance_threshold": 8, "max_wait_s": 5.0})`.
"""

import random
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cache_router.hashing import rendezvous_owner

DEFAULT_IMBALANCE_THRESHOLD = 8
DEFAULT_MAX_WAIT_S = 5.0


def request_route_key(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The routing hint of a pending call: a GenerateRequest's `route_key`, else `session_id`.

    Duck-typed on the `route_key` attribute so this module imports nothing of the replicas.
    """
    if pending_request is None:
        return None
    args = list(pending_request.args[:1]) + list(pending_request.kwargs.values())
    for arg in args:
        key = getattr(arg, "route_key", None)
        if isinstance(key, str) and key:
            return key
    return getattr(pending_request.metadata, "session_id", None) or None


class ConversationRouter(RequestRouter):
    """Rendezvous-hash affinity on `GenerateRequest.route_key`, with a load spill-over."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.imbalance_threshold = DEFAULT_IMBALANCE_THRESHOLD
        self.max_wait_s = DEFAULT_MAX_WAIT_S

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_wait_s: float = DEFAULT_MAX_WAIT_S, **unknown) -> None:
        """Called by Serve with `RequestRouterConfig.request_router_kwargs`."""
        if unknown:
            raise ValueError(f"ConversationRouter: unknown request_router_kwargs {sorted(unknown)}")
        if not isinstance(imbalance_threshold, int) or imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be an int >= 0, got {imbalance_threshold!r}")
        if not isinstance(max_wait_s, (int, float)) or max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be a number > 0, got {max_wait_s!r}")
        self.imbalance_threshold = imbalance_threshold
        self.max_wait_s = float(max_wait_s)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        """One rank: [owner] for a keyed request, else every candidate (least loaded wins)."""
        if not candidate_replicas:
            return []
        key = request_route_key(pending_request)
        if key is None:
            return [self._by_load(candidate_replicas)]
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        owner = candidate_replicas[ids.index(rendezvous_owner(key, ids))]
        if self._should_spill(owner, candidate_replicas, pending_request):
            return [self._by_load(candidate_replicas)]
        return [[owner]]

    def _by_load(self, replicas: List[RunningReplica]) -> List[RunningReplica]:
        # Within one rank the framework takes the lowest cached queue length below
        # max_ongoing_requests (probing unknown ones); shuffling spreads ties.
        return random.sample(replicas, len(replicas))

    def _known_queue_len(self, replica: RunningReplica) -> Optional[int]:
        return self.replica_queue_len_cache.get(replica.replica_id)

    def _should_spill(self, owner: RunningReplica, replicas: List[RunningReplica],
                      pending_request: PendingRequest) -> bool:
        """Leave the owner only when it is known full or badly imbalanced, or the wait is too long."""
        if time.time() - pending_request.created_at > self.max_wait_s:
            return True
        owner_len = self._known_queue_len(owner)
        if owner_len is None:
            return False  # unknown is not full: let the framework probe the owner
        if owner_len >= owner.max_ongoing_requests:
            return True
        known = [n for n in map(self._known_queue_len, replicas) if n is not None]
        return owner_len - min(known) > self.imbalance_threshold

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give `replica` to the pending request it was chosen for (matched by identity).

        PRIVATE Ray API (ray/serve/_private/request_router/request_router.py, 2.60):
        the base matches by `internal_request_id`, which all handle calls made while
        serving one request share, and indexes only the first of them; the other calls
        of an `asyncio.gather` fan-out are then never fulfilled and hang forever. Each
        call has its own RequestMetadata object, so match on `metadata is request_metadata`.
        Touches `_pending_requests_by_id`, `_pending_requests_to_fulfill` (left to the
        framework's lazy clean-up, as the base does), `_cancel_routing_task_for_pending_request`,
        `_record_queue_wait_time` and `_remove_pending_request_from_indices`.
        """
        pending = self._pending_request_for(request_metadata)
        if pending is None:
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        # The id index holds at most one of the calls sharing an id: drop it only if it is this one.
        if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pending:
            self._remove_pending_request_from_indices(pending)

    def _pending_request_for(self, request_metadata) -> Optional[PendingRequest]:
        if request_metadata is None:
            return None
        indexed = self._pending_requests_by_id.get(request_metadata.internal_request_id)
        if indexed is not None and indexed.metadata is request_metadata and not indexed.future.done():
            return indexed
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None
