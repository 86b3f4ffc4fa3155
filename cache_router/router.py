"""ConversationRouter: the Ray Serve request router that sends a request where its prefix is cached.

Contract (runs inside each caller's process, on the handle's event loop; never blocks):
- Signals, from the `GenerateRequest` passed to the replica method (first positional arg
  or any kwarg): its `route_key` (else the handle's `session_id` option), the history key
  of its conversation, and the chained block hashes of its prompt ids (the replicas'
  prefix-cache function, `core.hashing.block_hashes`).
- Knowledge (`CacheKnowledge`): the replicas' reports (`record_routing_stats`: held block
  hashes and conversations, ~one period late) merged with what this router sent where.
- Policy (`cache_router.policy.choose`): the replica holding the conversation, else a far
  longer prefix, else the rendezvous owner of the route key, each only within the
  imbalance threshold; else the least loaded of two choices. A request that waited
  `max_wait_s` goes to the least loaded replica; one without a key too.
- One rank, never a fallback rank: a slow queue-length probe must not move a key (the
  framework retries the same choice with a longer deadline).
- The router writes its per-replica predictions of cached tokens and the policy step
  onto the request (`predicted_cached_tokens`, `route_reason`): the replica compares
  them with what it delivered (a routing miss and an eviction told apart), and
  `RouterMetrics` exports them.
- Fan-out: each pending request gets the replica chosen for it, also when several
  share one `internal_request_id` (see `_fulfill_next_pending_request`).

Configure with `RequestRouterConfig(request_router_class=ConversationRouter,
request_router_kwargs={...})`, the keyword arguments of `initialize_state`.
"""

import random
import time
from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, ReplicaID, RunningReplica

from cache_router.knowledge import CacheKnowledge
from cache_router.metrics import RouterMetrics
from cache_router.policy import Candidate, PolicyConfig, choose
from core.hashing import block_hashes, short_hash

DEFAULT_IMBALANCE_THRESHOLD = 8
DEFAULT_MAX_WAIT_S = 5.0
DEFAULT_MIN_PREFIX_BLOCKS = 4
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KNOWLEDGE_TTL_S = 15.0
_MEMO_SIZE = 1024


def routed_request(pending_request: Optional[PendingRequest]):
    """The call's GenerateRequest (duck-typed on `route_key`: this module imports nothing of the replicas)."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args[:1]) + list(pending_request.kwargs.values()):
        if hasattr(arg, "route_key") and hasattr(arg, "prompt_token_ids"):
            return arg
    return None


def request_route_key(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The routing hint of a pending call: a GenerateRequest's `route_key`, else `session_id`."""
    if pending_request is None:
        return None
    request = routed_request(pending_request)
    key = getattr(request, "route_key", None)
    if isinstance(key, str) and key:
        return key
    return getattr(pending_request.metadata, "session_id", None) or None


class ConversationRouter(RequestRouter):
    """Cache-aware affinity on `GenerateRequest`s, rendezvous hashing underneath, a load spill-over."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_wait_s: float = DEFAULT_MAX_WAIT_S,
                         min_prefix_blocks: int = DEFAULT_MIN_PREFIX_BLOCKS,
                         block_size: int = DEFAULT_BLOCK_SIZE,
                         knowledge_ttl_s: float = DEFAULT_KNOWLEDGE_TTL_S, **unknown) -> None:
        """Called by Serve with `RequestRouterConfig.request_router_kwargs`."""
        if unknown:
            raise ValueError(f"ConversationRouter: unknown request_router_kwargs {sorted(unknown)}")
        for name, value in (("imbalance_threshold", imbalance_threshold), ("min_prefix_blocks", min_prefix_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        for name, value in (("max_wait_s", max_wait_s), ("knowledge_ttl_s", knowledge_ttl_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.policy = PolicyConfig(imbalance_threshold, min_prefix_blocks)
        self.max_wait_s = float(max_wait_s)
        self.block_size = block_size
        self.knowledge = CacheKnowledge(ttl_s=float(knowledge_ttl_s))
        self.router_metrics = RouterMetrics()
        self._blocks_memo: OrderedDict[str, list[int]] = OrderedDict()  # request id -> short block hashes

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        """One rank: the policy's choice for a keyed request, else every candidate (least loaded wins)."""
        if not candidate_replicas:
            return []
        key = request_route_key(pending_request)
        request = routed_request(pending_request)
        waited = pending_request is not None and time.time() - pending_request.created_at > self.max_wait_s
        if key is None or waited:
            self._note(request, candidate_replicas, None, "waited" if waited else "load")
            return [self._by_load(candidate_replicas)]
        now = time.monotonic()
        blocks = self._prompt_blocks(request)
        candidates = [self._candidate(r, request, key, blocks, now) for r in candidate_replicas]
        choice = choose(candidates, key, self.policy, self.knowledge.shared_blocks(blocks))
        self._note(request, candidate_replicas, candidates, choice.reason)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in choice.replica_ids]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The request was accepted by `replica_id`: remember what it now holds; export the decision."""
        request = routed_request(pending_request)
        rid = replica_id.unique_id
        self.knowledge.record_routed(rid, request_route_key(pending_request), self._prompt_blocks(request))
        predictions = getattr(request, "predicted_cached_tokens", None) or {}
        predicted = predictions.get(rid, 0)
        best_elsewhere = max((n for other, n in predictions.items() if other != rid), default=0)
        self.router_metrics.record(rid, getattr(request, "route_reason", "") or "load", predicted, best_elsewhere)
        self._blocks_memo.pop(getattr(request, "request_id", None), None)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """A replica that died or was removed drops out of the knowledge at once."""
        super().update_replicas(replicas)
        self.knowledge.retain_only(r.replica_id.unique_id for r in replicas)

    def _prompt_blocks(self, request) -> list[int]:
        """Short hashes of the full blocks of the request's prompt ids, computed once per request."""
        if request is None:
            return []
        blocks = self._blocks_memo.get(request.request_id)
        if blocks is None:
            blocks = [short_hash(h) for h in block_hashes(request.prompt_token_ids, self.block_size)]
            self._blocks_memo[request.request_id] = blocks
            while len(self._blocks_memo) > _MEMO_SIZE:
                self._blocks_memo.popitem(last=False)
        return blocks

    def _candidate(self, replica: RunningReplica, request, key: str, blocks: list[int], now: float) -> Candidate:
        rid = replica.replica_id.unique_id
        self.knowledge.observe_report(rid, replica.routing_stats)
        history = getattr(request, "history_key", None)
        return Candidate(
            replica_id=rid,
            queue_len=self.replica_queue_len_cache.get(replica.replica_id),
            max_ongoing=replica.max_ongoing_requests,
            holds_conversation=self.knowledge.holds_conversation(
                rid, short_hash(history) if history else None, key, now),
            matched_blocks=self.knowledge.matched_blocks(rid, blocks, now))

    def _note(self, request, replicas: List[RunningReplica], candidates: Optional[List[Candidate]],
              reason: str) -> None:
        """Writes the policy step and the per-replica cached-token predictions onto the request."""
        if request is None or not hasattr(request, "predicted_cached_tokens"):
            return
        request.route_reason = reason
        if candidates is None:
            now = time.monotonic()
            blocks = self._prompt_blocks(request)
            candidates = [Candidate(r.replica_id.unique_id, None, r.max_ongoing_requests,
                                    matched_blocks=self.knowledge.matched_blocks(r.replica_id.unique_id, blocks, now))
                          for r in replicas]
        request.predicted_cached_tokens = {c.replica_id: self._predicted_tokens(request, c) for c in candidates}

    def _predicted_tokens(self, request, candidate: Candidate) -> int:
        """Prompt tokens the candidate should serve from cache: its matched blocks, or the history of a
        conversation it holds; never the whole prompt (the last token is always computed)."""
        tokens = candidate.matched_blocks * self.block_size
        span = getattr(request, "new_turn_span", None)
        if candidate.holds_conversation and span is not None:  # the history, in whole blocks as cached
            tokens = max(tokens, span[0] // self.block_size * self.block_size)
        return max(0, min(tokens, len(request.prompt_token_ids) - 1))

    def _by_load(self, replicas: List[RunningReplica]) -> List[RunningReplica]:
        # Within one rank the framework takes the lowest cached queue length below
        # max_ongoing_requests (probing unknown ones); shuffling spreads ties.
        return random.sample(replicas, len(replicas))

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give `replica` to the pending request it was chosen for (matched by identity).

        PRIVATE Ray API (python/ray/serve/_private/request_router/request_router.py, 2.60):
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
