"""ConversationRouter: the Ray Serve request router that sends a request where its prefix is cached.

Contract (runs inside each caller's process, on the handle's event loop; never blocks):
- Signals, from the `GenerateRequest` passed to the replica method (first positional arg
  or any kwarg): its `route_key` (else the handle's `session_id` option), the history key
  of its conversation, and the chained block hashes of its prompt ids (the replicas'
  prefix-cache function, `core.hashing.block_hashes`).
- Knowledge (`CacheKnowledge`): the replicas' reports (`record_routing_stats`: held block
  hashes and conversations, ~one period late) merged with what this router sent where;
  inverted (a block -> the replicas holding it), so a decision reads one entry per prompt
  block and hashes the key only against the replicas a policy step weighs (`policy.py`, "Cost").
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
from cache_router.policy import Candidates, PolicyConfig, choose
from cache_router.roster import Roster
from core.hashing import block_hashes, short_hash, short_hashes

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
        self._roster: Optional[Roster] = None  # of the last candidate list

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
        roster = self._roster_of(candidate_replicas)
        now = time.monotonic()
        blocks = self._prompt_blocks(request)
        by_matched = self.knowledge.matched_blocks(roster.live, blocks, now)
        if key is None or waited:
            self._note(request, roster, [], by_matched, "waited" if waited else "load")
            return [self._by_load(candidate_replicas)]
        history = getattr(request, "history_key", None)
        holders = self.knowledge.conversation_holders(roster.live, short_hash(history) if history else None, key, now)
        choice = choose(self._candidates(roster, holders, by_matched), key, self.policy,
                        self.knowledge.shared_blocks(blocks))
        self._note(request, roster, holders, by_matched, choice.reason)
        return [[roster.by_id[rid] for rid in choice.replica_ids]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The request was accepted by `replica_id`: remember what it now holds; export the decision."""
        request = routed_request(pending_request)
        rid = replica_id.unique_id
        self.knowledge.record_routed(rid, request_route_key(pending_request), self._prompt_blocks(request))
        predictions = getattr(request, "predicted_cached_tokens", None) or {}
        elsewhere = dict(predictions)
        predicted = elsewhere.pop(rid, 0)
        best_elsewhere = max(elsewhere.values(), default=0)
        self.router_metrics.record(rid, getattr(request, "route_reason", "") or "load", predicted, best_elsewhere)
        self._blocks_memo.pop(getattr(request, "request_id", None), None)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """A replica that died or was removed drops out of the knowledge at once. Serve also hands the router
        new routing stats this way (each RunningReplicaInfo broadcast), so reports are taken in here, off the
        decisions' path (a decision only checks that each replica's report is the one taken)."""
        super().update_replicas(replicas)
        self.knowledge.retain_only(r.replica_id.unique_id for r in replicas)
        self._roster = None  # its mask may name slots the knowledge just freed
        self._roster_of(replicas)

    def _roster_of(self, replicas: List[RunningReplica]) -> Roster:
        """The roster of this candidate list (the last one's, when Serve passes the same list), reports taken."""
        if self._roster is None or not self._roster.is_for(replicas):
            self._roster = Roster(replicas, self.knowledge)
        self._roster.observe_reports(self.knowledge)
        return self._roster

    def _candidates(self, roster: Roster, holders: List[str], by_matched: dict) -> Candidates:
        """The policy's view: loads and limits looked up only for the replicas it weighs."""
        queue_lens = self.replica_queue_len_cache
        return Candidates(roster.ids, lambda rid: queue_lens.get(roster.by_id[rid].replica_id),
                          lambda rid: roster.by_id[rid].max_ongoing_requests, holders, by_matched)

    def _prompt_blocks(self, request) -> list[int]:
        """Short hashes of the full blocks of the request's prompt ids, computed once per request."""
        if request is None:
            return []
        blocks = self._blocks_memo.get(request.request_id)
        if blocks is None:
            blocks = short_hashes(block_hashes(request.prompt_token_ids, self.block_size))
            self._blocks_memo[request.request_id] = blocks
            while len(self._blocks_memo) > _MEMO_SIZE:
                self._blocks_memo.popitem(last=False)
        return blocks

    def _note(self, request, roster: Roster, holders: List[str], by_matched: dict, reason: str) -> None:
        """Writes the policy step and the per-replica cached-token predictions onto the request: its matched
        blocks, or the history of a conversation it holds; never the whole prompt (the last token is always
        computed)."""
        if request is None or not hasattr(request, "predicted_cached_tokens"):
            return
        request.route_reason = reason
        last = len(request.prompt_token_ids) - 1
        predicted = dict.fromkeys(roster.ids, 0)
        for count, replica_ids in by_matched.items():
            predicted.update(dict.fromkeys(replica_ids, max(0, min(count * self.block_size, last))))
        span = getattr(request, "new_turn_span", None)
        if span is not None:  # the history, in whole blocks as cached
            history_tokens = max(0, min(span[0] // self.block_size * self.block_size, last))
            for replica_id in holders:
                predicted[replica_id] = max(predicted[replica_id], history_tokens)
        request.predicted_cached_tokens = predicted

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
