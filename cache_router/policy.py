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
"""

from dataclasses import dataclass

from core.hashing import rendezvous_rank


@dataclass(frozen=True)
class PolicyConfig:
    imbalance_threshold: int = 8  # most ongoing requests a choice may exceed the least loaded by
    min_prefix_blocks: int = 4  # blocks a prefix match must save over the rendezvous owner


@dataclass
class Candidate:
    """One live replica as the router sees it for one request."""

    replica_id: str
    queue_len: int | None  # ongoing requests; None: unknown
    max_ongoing: int
    holds_conversation: bool = False
    matched_blocks: int = 0  # leading blocks of the request's prompt it holds


@dataclass
class Choice:
    replica_ids: list[str]  # one rank: the framework sends to the least loaded of these
    reason: str


def choose(candidates: list[Candidate], route_key: str | None, config: PolicyConfig,
           shared_blocks: int = 0) -> Choice:
    """The rank to route to. `shared_blocks`: leading blocks of the prompt that several
    conversations share (they earn no prefix preference)."""
    if not candidates:
        return Choice([], "none")
    if route_key is None:
        by_load = sorted(candidates, key=lambda c: (c.queue_len is not None, c.queue_len or 0))
        return Choice([c.replica_id for c in by_load], "load")
    by_id = {c.replica_id: c for c in candidates}
    ranked = [by_id[rid] for rid in rendezvous_rank(route_key, list(by_id))]
    floor = min((c.queue_len for c in candidates if c.queue_len is not None), default=0)

    def within_load(c: Candidate) -> bool:
        if c.queue_len is None:
            return True
        return c.queue_len < c.max_ongoing and c.queue_len - floor <= config.imbalance_threshold

    holders = [c for c in ranked if c.holds_conversation]
    best = _best_prefix(ranked, config, shared_blocks)
    owner = ranked[0]
    steps = [(c, "conversation") for c in holders] + [(best, "prefix"), (owner, "rendezvous")]
    for candidate, reason in steps:
        if candidate is not None and within_load(candidate):
            return Choice([candidate.replica_id], reason)
    preferred = holders[0] if holders else best or owner
    second = next((c for c in ranked if c is not preferred), None)
    if second is None:
        return Choice([preferred.replica_id], "balance")
    return Choice([preferred.replica_id, second.replica_id], "balance")


def _best_prefix(ranked: list[Candidate], config: PolicyConfig, shared_blocks: int) -> Candidate | None:
    """The replica whose own (unshared) matched blocks beat the owner's by `min_prefix_blocks`, if any."""

    def own_blocks(c: Candidate) -> int:
        return max(0, c.matched_blocks - shared_blocks)

    best = max(ranked, key=own_blocks)  # the first of equals: the best-ranked by rendezvous
    if own_blocks(best) - own_blocks(ranked[0]) >= config.min_prefix_blocks:
        return best
    return None
