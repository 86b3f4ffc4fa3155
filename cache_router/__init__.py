"""Prefix hashing and the Ray Serve request router.

`cache_router.hashing` is pure Python (the replicas import it); `cache_router.router`
imports Ray and is imported only where a deployment is configured.
"""

from cache_router.hashing import (
    block_hashes,
    canonical_message,
    extend_history_key,
    history_key,
    prefix_hash,
    rendezvous_owner,
    rendezvous_rank,
    route_key,
)

__all__ = [
    "block_hashes",
    "canonical_message",
    "extend_history_key",
    "history_key",
    "prefix_hash",
    "rendezvous_owner",
    "rendezvous_rank",
    "route_key",
]
