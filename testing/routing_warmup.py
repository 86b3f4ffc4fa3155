"""Until a live app's ingress routes to each of its replicas: serve.run returns when the replicas are healthy,
but the ingress's router learns the replica set a moment later (Serve's long poll), and requests sent before it
does all go to the replicas it knows. Used by the Ray tests' session app and the migration scenarios."""

import time

import httpx

from core.hashing import rendezvous_owner, route_key
from serve_app.routes import REPLICA_HEADER


def wait_until_routed_to_each(base_url: str, replica_ids: list[str], model: str, timeout_s: float = 60.0) -> None:
    """Sends one-turn requests to `model` whose rendezvous owners cover every replica until each replica has
    served one; fails after `timeout_s`."""
    served: set[str] = set()
    deadline = time.monotonic() + timeout_s
    i = 0
    while served != set(replica_ids) and time.monotonic() < deadline:
        texts = {}  # fresh conversations each round: a conversation that landed once stays where it landed
        while len(texts) < len(replica_ids):
            text = f"warm-up {i}"
            texts.setdefault(rendezvous_owner(route_key("", model, messages=[{"role": "user", "content": text}]),
                                              replica_ids), text)
            i += 1
        for text in texts.values():
            reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                               json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
            served.add(reply.headers.get(REPLICA_HEADER))
        time.sleep(0.2)
    assert served == set(replica_ids), f"after {timeout_s} s the ingress routes only to {served}"
