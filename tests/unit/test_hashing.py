"""core.hashing: chained block hashes, route and history keys, rendezvous ranking."""

import hashlib
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from core.hashing import (
    block_hashes,
    canonical_message,
    extend_history_key,
    history_key,
    prefix_hash,
    rendezvous_owner,
    rendezvous_rank,
    route_key,
    short_hash,
    short_hashes,
)

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


# --- block hashes ---------------------------------------------------------------

def test_block_hashes_are_chained_prefixes():
    ids = list(range(100))
    full = block_hashes(ids, 16)
    assert block_hashes(ids[:48], 16) == full[:3]
    assert block_hashes(ids[16:32], 16, parent=full[0]) == [full[1]]
    changed = [7] + ids[1:]
    assert all(a != b for a, b in zip(block_hashes(changed, 16), full))  # block 0 feeds every later one


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert block_hashes(list(range(47)), 16) == block_hashes(list(range(32)), 16)
    assert all(len(h) == 16 for h in block_hashes(list(range(64)), 16))


def test_block_hashes_depend_on_order_and_size():
    assert block_hashes([1, 2, 3, 4], 2) != block_hashes([2, 1, 3, 4], 2)
    assert block_hashes([1, 2, 3, 4], 4) != block_hashes([1, 2, 3, 4], 2)[1:]
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_prefix_hash_is_exact_length():
    assert prefix_hash([1, 2, 3]) == prefix_hash([1, 2, 3])
    assert prefix_hash([1, 2, 3]) != prefix_hash([1, 2])
    assert prefix_hash([0]) != prefix_hash([])
    assert len(prefix_hash([5] * 17)) == 16


_SUBPROCESS_SNIPPET = """
from core.hashing import block_hashes, prefix_hash, route_key, history_key, rendezvous_owner
print(block_hashes(list(range(40)), 16)[-1].hex())
print(prefix_hash([3, 1, 4]).hex())
print(route_key("alice", "m", messages=[{"role": "user", "content": "hi"}]))
print(route_key("alice", "m", token_ids=list(range(70))))
print(history_key("alice", "m", {"enable_thinking": False}, [{"role": "user", "content": "hi"}]))
print(rendezvous_owner("k", ["a", "b", "c"]))
"""


def test_hashes_are_deterministic_across_processes():
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different str-hash seed than this process
    out = subprocess.run([sys.executable, "-c", _SUBPROCESS_SNIPPET], check=True, capture_output=True,
                         text=True, env=env, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert out == [
        block_hashes(list(range(40)), 16)[-1].hex(),
        prefix_hash([3, 1, 4]).hex(),
        route_key("alice", "m", messages=[{"role": "user", "content": "hi"}]),
        route_key("alice", "m", token_ids=list(range(70))),
        history_key("alice", "m", {"enable_thinking": False}, [{"role": "user", "content": "hi"}]),
        rendezvous_owner("k", ["a", "b", "c"]),
    ]


# --- canonical messages ---------------------------------------------------------

def test_canonical_message_keeps_render_fields_and_drops_none():
    msg = {"role": "assistant", "content": None, "name": None, "refusal": None, "audio": None,
           "tool_calls": [{"id": "c1", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}],
           "reasoning_content": "think"}
    canonical = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
                 "reasoning_content": "think"}
    assert canonical_message(msg) == canonical
    assert canonical_message(canonical) == canonical  # idempotent: a replica extends keys with canonical replies


def test_a_tool_call_is_keyed_by_what_the_model_wrote_not_how_the_client_serialised_it():
    def turn(arguments: str, content=None, call_id: str = "call_1") -> list[dict]:
        call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": [call]}]

    key = history_key("c", "m", {}, turn('{"city": "Paris", "days": 2}'))
    assert history_key("c", "m", {}, turn('{ "days":2,\n "city":"Paris" }')) == key  # spacing, key order
    assert history_key("c", "m", {}, turn('{"city": "Paris", "days": 2}', content="", call_id="x")) == key
    assert history_key("c", "m", {}, turn('{"city": "Lyon", "days": 2}')) != key  # an edited argument
    assert history_key("c", "m", {}, turn('{"city": "Paris"')) != key  # not JSON: kept as text


def test_canonical_message_normalises_content_parts():
    parts = [{"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]
    assert canonical_message({"role": "user", "content": parts})["content"] == [
        "look", {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]
    other_image = [parts[0], {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBB"}}]
    assert history_key("c", "m", {}, [{"role": "user", "content": parts}]) != \
        history_key("c", "m", {}, [{"role": "user", "content": other_image}])


# --- route key ------------------------------------------------------------------

def test_route_key_ignores_turns_after_first_user_message():
    first = route_key("alice", "m", messages=CONVERSATION[:2])
    assert route_key("alice", "m", messages=CONVERSATION) == first
    assert route_key("alice", "m", messages=CONVERSATION[:3]) == first


def test_route_key_differs_by_caller_model_and_first_user_message():
    base = route_key("alice", "m", messages=CONVERSATION)
    assert route_key("bob", "m", messages=CONVERSATION) != base
    assert route_key("alice", "m2", messages=CONVERSATION) != base
    other = [SYSTEM, {"role": "user", "content": "What is 5+5?"}] + CONVERSATION[2:]
    assert route_key("alice", "m", messages=other) != base
    assert len(base) == 32 and int(base, 16) >= 0


def test_shared_system_prompt_does_not_collapse_conversations():
    a = route_key("alice", "m", messages=[SYSTEM, {"role": "user", "content": "one"}])
    b = route_key("alice", "m", messages=[SYSTEM, {"role": "user", "content": "two"}])
    assert a != b
    # No user message at all: every message counts.
    assert route_key("alice", "m", messages=[SYSTEM]) != \
        route_key("alice", "m", messages=[SYSTEM, {"role": "assistant", "content": "hi"}])


def test_route_key_token_ids():
    ids = list(range(200))
    key = route_key("alice", "m", token_ids=ids)
    assert route_key("alice", "m", token_ids=ids[:64]) == key  # only the first 4 blocks count
    assert route_key("alice", "m", token_ids=ids[:63]) != key
    assert route_key("alice", "m", token_ids=ids[:20]) == route_key("alice", "m", token_ids=ids[:16])
    assert route_key("alice", "m", token_ids=[1, 2, 3]) != route_key("alice", "m", token_ids=[1, 2])
    assert route_key("bob", "m", token_ids=ids) != key
    assert route_key("alice", "m", token_ids=ids, num_route_blocks=2) == \
        route_key("alice", "m", token_ids=ids[:32])


def test_route_key_takes_exactly_one_prompt():
    with pytest.raises(ValueError):
        route_key("alice", "m")
    with pytest.raises(ValueError):
        route_key("alice", "m", messages=CONVERSATION, token_ids=[1])


# --- history key ----------------------------------------------------------------

def test_history_key_chains_by_message():
    options = {"enable_thinking": False}
    for k in range(len(CONVERSATION)):
        assert extend_history_key(history_key("alice", "m", options, CONVERSATION[:k]), CONVERSATION[k]) \
            == history_key("alice", "m", options, CONVERSATION[:k + 1])


def test_history_key_depends_on_everything():
    base = history_key("alice", "m", {"enable_thinking": False}, CONVERSATION)
    assert history_key("alice", "m", {"enable_thinking": True}, CONVERSATION) != base
    assert history_key("alice", "m", {}, CONVERSATION) != base
    assert history_key("bob", "m", {"enable_thinking": False}, CONVERSATION) != base
    assert history_key("alice", "m", {"enable_thinking": False}, CONVERSATION[:-1]) != base
    reordered = {"enable_thinking": False, "a": 1}
    assert history_key("c", "m", reordered, []) == history_key("c", "m", dict(reversed(reordered.items())), [])
    # Keys that do not render (and None values) do not change it.
    noisy = [dict(m, refusal=None, extra="x") for m in CONVERSATION]
    assert history_key("alice", "m", {"enable_thinking": False}, noisy) == base


# --- rendezvous -----------------------------------------------------------------

def test_rendezvous_rank_is_deterministic_and_complete():
    ids = [f"replica-{i}" for i in range(5)]
    rank = rendezvous_rank("key", ids)
    assert sorted(rank) == sorted(ids)
    assert rendezvous_rank("key", list(reversed(ids))) == rank
    assert rendezvous_owner("key", ids) == rank[0]
    with pytest.raises(ValueError):
        rendezvous_owner("key", [])


def test_removing_a_non_owner_does_not_move_keys():
    ids = [f"replica-{i}" for i in range(4)]
    for n in range(50):
        key = f"conversation-{n}"
        owner = rendezvous_owner(key, ids)
        for gone in ids:
            if gone != owner:
                assert rendezvous_owner(key, [r for r in ids if r != gone]) == owner


def test_rendezvous_balances_two_replicas():
    counts = {"a1b2": 0, "c3d4": 0}
    for n in range(200):
        counts[rendezvous_owner(route_key("c", "m", token_ids=[n]), list(counts))] += 1
    assert all(60 <= c <= 140 for c in counts.values()), counts



# --- the fast forms against the definitions written plainly ------------------------

def naive_block_hashes(token_ids, block_size: int, parent: bytes | None = None) -> list[bytes]:
    """h_i = blake2b-128(h_{i-1} || block i's ids as int64 little-endian), full blocks only."""
    hashes, prev = [], bytes(16) if parent is None else parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        ids = token_ids[start:start + block_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{len(ids)}q", *ids), digest_size=16).digest()
        hashes.append(prev)
    return hashes


def naive_rendezvous_rank(key: str, replica_ids) -> list[str]:
    """Best first by the big-endian first 8 bytes of blake2b-128(key || NUL || id); ties by id."""
    def score(rid: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode() + b"\x00" + rid.encode(), digest_size=16).digest()[:8], "big")
    return sorted(replica_ids, key=lambda rid: (-score(rid), rid))


def test_block_hashes_equal_the_plain_chained_definition():
    rng = random.Random(5)
    for case in range(300):
        ids = [rng.randrange(-2**63, 2**63) if case % 5 == 0 else rng.randrange(200_000)
               for _ in range(rng.randrange(0, 70))]
        block_size, parent = rng.choice([1, 3, 4, 16]), None if case % 3 else bytes(range(16))
        assert block_hashes(ids, block_size, parent) == naive_block_hashes(ids, block_size, parent)
        assert block_hashes(tuple(ids), block_size, parent) == naive_block_hashes(ids, block_size, parent)
    assert block_hashes(list(range(40)), 16)[-1].hex() == "b3c2067565eefdb38a373a8b9c6ac4f1"  # pinned


def test_rendezvous_rank_and_owner_equal_the_plain_definition():
    rng = random.Random(6)
    for case in range(300):
        ids = ["".join(rng.choices("abcdef0123456789é", k=rng.randrange(1, 9))) for _ in range(rng.randrange(1, 30))]
        key = "".join(rng.choices("abcdefé\x00", k=rng.randrange(0, 40)))
        assert rendezvous_rank(key, ids) == naive_rendezvous_rank(key, ids)
        assert rendezvous_owner(key, ids) == naive_rendezvous_rank(key, ids)[0]
    assert rendezvous_rank("conversation-7", [f"r{i}" for i in range(6)]) == ["r2", "r0", "r5", "r3", "r1", "r4"]


def test_short_hashes_are_short_hash_of_each_digest():
    digests = block_hashes(list(range(200)), 4)
    assert short_hashes(digests) == [short_hash(d) for d in digests]
    assert short_hashes([]) == []
    with pytest.raises(ValueError):
        short_hashes([bytes(8)])


if __name__ == "__main__":
    import sys, pytest; sys.exit(pytest.main([__file__, "-q"]))
