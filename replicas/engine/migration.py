"""Migration: a replica's conversations exported as ConversationStates, and states imported into a replica.

Export (a replica leaving: replicas/deployment.py), most recently used conversation first, under a byte
budget and a deadline. For each retained conversation (its ids, under every history key that names
them): the KV of its leading full blocks still in the pool or the host tier (brought back first), and
on a hybrid model the longest checkpoint of its ids whose full blocks are among them (blocks past that
checkpoint are left: without a checkpoint a hybrid model cannot use them). A conversation whose KV is
gone still moves its ids; so does an earlier turn of a conversation already exported (its blocks are a
prefix of that state's: the chained hash of its last block says so).

Import (the next turn arrived at a replica that does not hold the conversation): the state is checked
whole (ConversationState.check: layout, hashes, shapes) and refused on any difference; then the blocks
join the prefix cache as cached free blocks, the checkpoint joins the checkpoint pool (only when all of
its full blocks made it in), and the ids join the retained store under the state's own caller. What
does not fit is left out: the turn recomputes it. Both run on the step thread (AsyncEngine.call).
"""

import time
from dataclasses import dataclass

from core.hashing import block_hashes
from replicas.cache.block_io import insert_cached, read_blocks
from replicas.cache.conversation_state import ConversationState, StateLayout, StateRefused, compute_identity, \
    model_fingerprint


@dataclass
class MigrationStats:
    num_states_exported: int = 0
    num_state_bytes_exported: int = 0
    num_states_left_behind: int = 0  # over the byte budget or past the deadline
    num_states_imported: int = 0
    num_blocks_imported: int = 0
    num_checkpoints_imported: int = 0
    num_imports_refused: int = 0


def engine_layout(engine) -> StateLayout:
    k = engine.runner.kv_caches[0][0]  # [num_blocks, block_size, Hkv, D]
    linear = engine.runner.linear_states or []
    return StateLayout(model=model_fingerprint(engine.config.model), dtype=str(engine.dtype),
                       compute=compute_identity(engine.device, engine.config), block_size=engine.config.block_size,
                       kv_block_shape=(len(engine.runner.kv_caches), 2, *k.shape[1:]),
                       linear_state_shapes=tuple(tuple(t.shape[1:]) for s in linear
                                                 for t in (s.conv_state, s.recurrent_state)))


def export_states(engine, max_bytes: int, deadline: float) -> list[ConversationState]:
    """The engine's retained conversations as states, most recently used first, at most `max_bytes` in
    all, exported before `deadline` (time.monotonic()). Changes nothing but what the host tier brings back."""
    groups: dict[tuple[str, tuple[int, ...]], list[str]] = {}  # (caller, ids) -> keys, most recent first
    for key, entry in reversed(engine.retention.store.items()):
        groups.setdefault((entry.caller, tuple(entry.token_ids)), []).append(key)
    states, total, carried = [], 0, set()  # carried: the block hashes an exported state already carries
    for (caller, ids), keys in groups.items():
        if time.monotonic() >= deadline:
            engine.migration_stats.num_states_left_behind += 1
            continue
        hashes = block_hashes(ids, engine.config.block_size)
        if hashes and hashes[-1] in carried:  # an earlier turn of a state exported (chained hashes): its ids alone
            state = ConversationState(engine.layout, caller, list(keys), list(ids))
        else:
            state = _export_one(engine, caller, list(ids), keys, hashes)
        carried.update(state.block_hashes)
        if total + state.num_bytes > max_bytes:
            engine.migration_stats.num_states_left_behind += 1
            continue
        total += state.num_bytes
        states.append(state)
    engine.migration_stats.num_states_exported += len(states)
    engine.migration_stats.num_state_bytes_exported += total
    return states


def _export_one(engine, caller: str, ids: list[int], keys: list[str], hashes: list[bytes]) -> ConversationState:
    """hashes: the chained hashes of the full blocks of `ids`."""
    if engine.host_tier is not None:  # what the host tier holds of it moves too: back into the pools first
        if engine.checkpointer is not None:
            engine.checkpointer.bring_back(ids, hashes)
        else:
            engine.host_tier.restore(hashes, len(hashes))
    held = []  # the leading full blocks the pool still holds
    for block_hash in hashes:
        block_id = engine.block_pool.find(block_hash)
        if block_id is None:
            break
        held.append(block_id)
    checkpoint = None
    if engine.is_hybrid:
        usable = [cp for cp in engine.checkpointer.pool.lookup(ids, len(ids) - 1)
                  if cp.num_tokens // engine.config.block_size <= len(held)] if engine.checkpointer else []
        checkpoint = usable[0] if usable else None
        held = held[:checkpoint.num_tokens // engine.config.block_size] if checkpoint else []
    kv = read_blocks(engine.runner.kv_caches, held) if held else None
    return ConversationState(engine.layout, caller, list(keys), ids, hashes[:len(held)], kv, checkpoint)


def import_state(engine, state: ConversationState) -> int:
    """Puts `state` into the engine. -> prompt tokens it now serves from cache for the conversation's next
    turn (the blocks, or the checkpoint). Raises StateRefused (and changes nothing) for a state that does
    not belong here."""
    try:
        state.check(engine.layout)
    except StateRefused:
        engine.migration_stats.num_imports_refused += 1
        raise
    block_size = engine.config.block_size
    num_blocks = 0
    if state.kv is not None:
        num_blocks = insert_cached(engine.block_pool, engine.runner.kv_caches, state.block_hashes, state.kv)
    cached = num_blocks * block_size
    cp = state.checkpoint
    if engine.is_hybrid:
        cached = 0
        if cp is not None and engine.checkpointer is not None and cp.num_tokens // block_size <= num_blocks:
            engine.checkpointer.pool.save(state.token_ids[:cp.num_tokens], cp)
            engine.migration_stats.num_checkpoints_imported += 1
            cached = cp.num_tokens
    for key in state.history_keys:
        engine.retention.store.put(key, state.caller, state.token_ids)
    engine.migration_stats.num_states_imported += 1
    engine.migration_stats.num_blocks_imported += num_blocks
    return cached
