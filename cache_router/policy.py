"""The routing policy: which replica(s) may serve a request, from what the router knows of each.

Pure: no Ray, no clock, no randomness; the same inputs give the same choice in
every ingress process. Steps, first that applies wins (`Choice.reason`):

1. "conversation": a replica holding the conversation (its retained ids), if its
   load is within the imbalance threshold;
2. "prefix": the replica with the longest matching prefix in blocks, if that beats
   the rendezvous owner's match by at least `min_prefix_blocks` blocks (blocks that
   several conversations share, like a common system prompt, do not count: every
   replica ends up holding those, so they must not pull all traffic to one) and its
   load is within the threshold;
3. "rendezvous": the owner of the route key among the live replicas;
4. "balance": the preferred replica above is over the threshold or full: the least
   loaded of two choices, the preferred one and the key's next rendezvous choice
   (deterministic, so a hot conversation spills to one place and its cache follows).
Without a route key: "load", every candidate, least loaded first (the framework
picks the lowest queue among one rank).

Load is a replica's number of ongoing requests as the router last saw it; an
unknown load counts as within the threshold (the framework probes it).

Cost: a step reads only the replicas it weighs. A holder within the threshold is chosen after
hashing the key against the holders alone; the whole rendezvous order (one hash per live replica)
is computed only when a later step needs the owner; the least load only when a queue exceeds the threshold.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from core.hashing import rendezvous_order


@dataclass(frozen=True)
class PolicyConfig:
    imbalance_threshold: int = 8  # most ongoing requests a choice may exceed the least loaded by
    min_prefix_blocks: int = 4  # blocks a prefix match must save over the rendezvous owner


@dataclass
class Candidates:
    """The live replicas as the router sees them for one request: lookups, not a row per replica."""

    replica_ids: Sequence[str]
    queue_len: Callable[[str], int | None]  # ongoing requests (a count); None: unknown
    max_ongoing: Callable[[str], int]
    holders: Collection[str] = ()  # the replicas holding the conversation
    # leading blocks of the request's prompt held -> the replicas holding exactly that many (none: left out)
    by_matched_blocks: Mapping[int, Sequence[str]] = field(default_factory=dict)


@dataclass
class Choice:
    replica_ids: list[str]  # one rank: the framework sends to the least loaded of these
    reason: str


def choose(candidates: Candidates, route_key: str | None, config: PolicyConfig,
           shared_blocks: int = 0) -> Choice:
    """The rank to route to. `shared_blocks`: leading blocks of the prompt that several
    conversations share (they earn no prefix preference)."""
    if not candidates.replica_ids:
        return Choice([], "none")
    if route_key is None:
        queue_len = candidates.queue_len
        return Choice(sorted(candidates.replica_ids, key=lambda r: (queue_len(r) is not None, queue_len(r) or 0)),
                      "load")
    order = rendezvous_order(route_key)
    is_within = _LoadCheck(candidates, config).is_within
    holders = sorted(candidates.holders, key=order)
    for replica_id in holders:
        if is_within(replica_id):
            return Choice([replica_id], "conversation")
    top_two = sorted(candidates.replica_ids, key=order)[:2]
    best = _best_prefix(candidates, order, top_two[0], config, shared_blocks)
    for replica_id, reason in ((best, "prefix"), (top_two[0], "rendezvous")):
        if replica_id is not None and is_within(replica_id):
            return Choice([replica_id], reason)
    preferred = holders[0] if holders else best if best is not None else top_two[0]
    second = next((r for r in top_two if r != preferred), None)
    return Choice([preferred] if second is None else [preferred, second], "balance")


class _LoadCheck:
    """Within the threshold: below max_ongoing and at most `imbalance_threshold` above the least loaded.
    The least load is read only for a queue longer than the threshold (queues are counts, >= 0, so a
    shorter one is within the threshold of any least load)."""

    def __init__(self, candidates: Candidates, config: PolicyConfig):
        self.candidates = candidates
        self.threshold = config.imbalance_threshold
        self._floor: int | None = None

    def is_within(self, replica_id: str) -> bool:
        queue_len = self.candidates.queue_len(replica_id)
        if queue_len is None:
            return True
        if queue_len >= self.candidates.max_ongoing(replica_id):
            return False
        return queue_len <= self.threshold or queue_len - self._least_load() <= self.threshold

    def _least_load(self) -> int:
        if self._floor is None:
            loads = map(self.candidates.queue_len, self.candidates.replica_ids)
            self._floor = min((n for n in loads if n is not None), default=0)
        return self._floor


def _best_prefix(candidates: Candidates, order, owner: str, config: PolicyConfig,
                 shared_blocks: int) -> str | None:
    """The replica whose own (unshared) matched blocks beat the owner's by `min_prefix_blocks`, if any;
    the first of equals by rendezvous order."""
    by_matched = candidates.by_matched_blocks
    most = max(by_matched, default=0)
    most_own = max(0, most - shared_blocks)
    owner_matched = next((n for n, ids in by_matched.items() if owner in ids), 0)
    if most_own - max(0, owner_matched - shared_blocks) < config.min_prefix_blocks:
        return None
    if most_own == 0:  # nobody holds an unshared block: all equal, the owner first
        return owner
    return min(by_matched[most], key=order)
