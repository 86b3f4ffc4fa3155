"""The Ray Serve request router: which replica holds a conversation's state.

`cache_router.router` imports Ray and is imported only where a deployment is configured; the hashes it
routes by are `core/hashing.py`'s (pure Python, shared with the ingress and the replicas).
"""
