"""StateDepot: bounded by bytes and age, a state taken once and by its own caller only."""

import torch

from replicas.cache.conversation_state import ConversationState, StateLayout
from replicas.depot import StateDepot

LAYOUT = StateLayout(model="m", dtype="torch.float32", compute="cpu", block_size=4, kv_block_shape=(1, 2, 4, 1, 2))


def state(caller: str, keys: list[str], num_blocks: int = 1) -> ConversationState:
    return ConversationState(LAYOUT, caller, keys, list(range(4 * num_blocks + 1)), [b"h"] * num_blocks,
                             torch.zeros(num_blocks, 1, 2, 4, 1, 2))


def test_a_state_is_taken_once_under_any_of_its_keys_by_its_caller_only():
    depot = StateDepot()
    assert depot.put([state("alice", ["k1", "k1-reasoning"])]) == 1
    assert depot.take("k1", "bob") is None and depot.stats["num_takes_refused"] == 1
    taken = depot.take("k1-reasoning", "alice")
    assert taken is not None and taken.caller == "alice"
    assert depot.take("k1", "alice") is None  # gone under every key
    assert depot.depot_stats()["num_states"] == 0 and depot.num_bytes == 0


def test_a_later_state_for_a_key_replaces_the_earlier():
    depot = StateDepot()
    depot.put([state("a", ["k"], num_blocks=1)])
    depot.put([state("a", ["k"], num_blocks=3)])
    assert len(depot.take("k", "a").block_hashes) == 3
    assert depot.num_bytes == 0


def test_bounded_by_bytes_oldest_first_and_by_age():
    one = state("a", ["first"]).num_bytes
    depot = StateDepot(max_bytes=2 * one)
    depot.put([state("a", ["first"]), state("a", ["second"]), state("a", ["third"])])
    assert depot.take("first", "a") is None and depot.take("third", "a") is not None
    assert depot.num_bytes == one
    too_big = StateDepot(max_bytes=one - 1)
    assert too_big.put([state("a", ["k"])]) == 0 and too_big.num_bytes == 0
    aged = StateDepot(ttl_s=1e-9)
    aged.put([state("a", ["k"])])
    assert aged.take("k", "a") is None and aged.stats["num_states_dropped"] == 1
