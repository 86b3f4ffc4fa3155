"""Checkpointer: a hybrid model's recurrent state saved at exact token boundaries and restored on admission.

Saved (only where a policy will consume it, never twice for one boundary; copies only the state
slot, the partial last block's KV and one hidden row, never the shared full blocks):
- at a request's checkpoint positions (the history boundary of a chat turn; every K prompt tokens
  when configured): with the native recurrent ops (`snapshots`) the step copies the states out after that
  token wherever it falls in a chunk (ModelRunner: LinearStateBatch.snapshot_rows); on the PyTorch path the
  scheduler ends a prefill chunk there, so the state exists in the slot at that token;
- at the end of a finished turn: the last position fed forward (prompt + generated ids but the last
  sampled one, which never ran through the model); the next turn prefills from there.

Restored when a request's leading ids are exactly a checkpoint's and the full blocks it needs are
still in the prefix cache (else the next shorter checkpoint, else from zero): full blocks shared,
tail KV copied into a fresh block, state copied into the request's slot. A checkpoint covering the
whole prompt leaves nothing to compute: the first token is sampled from its saved hidden row.

With a host tier (`tier`): the checkpoint pool's evictions go to it, and admission first brings back
the tier's checkpoints of the request's leading ids and the full blocks the longest one needs; the
rules above then apply unchanged.
"""

import torch

from core.hashing import prefix_hash
from replicas.cache.checkpoints import Checkpoint, CheckpointPool
from replicas.cache.kv_cache_manager import KVCacheManager
from replicas.models.gated_deltanet import LinearLayerState
from replicas.request.request import Request, RequestStatus


class Checkpointer:
    def __init__(self, pool: CheckpointPool, kv_manager: KVCacheManager,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], linear_states: list[LinearLayerState],
                 save_turn_ends: bool, every: int, snapshots: bool = False):
        self.pool = pool
        self.kv_manager = kv_manager
        self.kv_caches = kv_caches
        self.linear_states = linear_states
        self.block_size = kv_manager.block_size
        self.save_turn_ends = save_turn_ends
        self.every = every  # 0: off
        self.snapshots = snapshots  # the step copies states out inside chunks: no chunk ends on a position
        self.tier = None  # a HostTier (attach_tier), or None

    def attach_tier(self, tier) -> None:
        self.tier = tier
        self.pool.on_evict = tier.store_checkpoint

    def plan(self, request: Request, boundaries: list[int]) -> None:
        """Sets where the request's state is saved on the way: the given boundaries, every K prompt tokens."""
        positions = set(p for p in boundaries if 0 < p < request.num_prompt_tokens)
        if self.every:
            positions.update(range(self.every, request.num_prompt_tokens, self.every))
        request.checkpoint_positions = positions
        request.chunk_at_checkpoints = not self.snapshots

    # -- restore -------------------------------------------------------------

    def admit(self, request: Request, budget: int) -> int | None:
        """Starts a request that holds no blocks (its state slot is already assigned): from the longest
        usable checkpoint, else from zero. Returns the tokens to compute now (0: a whole-prompt hit),
        or None (and no change) if the pool is short."""
        num_tokens = self._admit(request, budget)
        if num_tokens is not None and self.tier is not None:  # once per admission, not per attempt
            self.kv_manager.update_hashes(request)
            self.tier.note_use(request.block_hashes[:request.num_prompt_tokens // self.block_size])
        return num_tokens

    def _admit(self, request: Request, budget: int) -> int | None:
        if not request.needs_prompt_logits:
            if self.tier is not None:
                self.kv_manager.update_hashes(request)
                self.bring_back(request.token_ids, request.block_hashes)
            for checkpoint in self.pool.lookup(request.token_ids, request.num_tokens):
                num_tokens = self._restore(request, checkpoint, budget)
                if num_tokens is not False:
                    return num_tokens
        return self.kv_manager.admit(request, min(budget, request.tokens_to_next_checkpoint()))

    def bring_back(self, token_ids: list[int], block_hashes: list[bytes]) -> None:
        """The tier's checkpoints of leading parts of `token_ids` (whose chained block hashes are
        `block_hashes`), longer than the pool's longest, come back to the pool, then the tier's full blocks
        that continue the pool's, up to the longest checkpoint's."""
        held = self.pool.lookup(token_ids, len(token_ids))
        longest = held[0].num_tokens if held else 0
        for checkpoint in self.tier.take_checkpoints(token_ids, len(token_ids), longest):
            self.pool.put(prefix_hash(token_ids[:checkpoint.num_tokens]), checkpoint)
            longest = max(longest, checkpoint.num_tokens)
        if longest >= self.block_size:
            self.tier.restore(block_hashes, longest // self.block_size)

    def _restore(self, request: Request, checkpoint: Checkpoint, budget: int):
        """-> tokens to compute, None if the pool is short, False if the checkpoint's blocks are gone."""
        num_full = checkpoint.num_tokens // self.block_size
        self.kv_manager.update_hashes(request)
        full = [self.kv_manager.pool.find(h) for h in request.block_hashes[:num_full]]
        if None in full:
            return False  # a full block was evicted: this checkpoint cannot be used alone
        num_new = min(request.num_tokens - checkpoint.num_tokens, budget,
                      request.tokens_to_next_checkpoint(checkpoint.num_tokens))
        if not self.kv_manager.take(request, full, checkpoint.num_tokens, num_new):
            return None
        self._copy_in(request, checkpoint)
        request.restored_hidden = checkpoint.hidden if num_new == 0 else None
        request.last_hidden = checkpoint.hidden
        self.pool.touch(request.token_ids[:checkpoint.num_tokens])
        return num_new

    def _copy_in(self, request: Request, checkpoint: Checkpoint) -> None:
        slot = request.state_slot
        for layer, conv, recurrent in zip(self.linear_states, checkpoint.conv_states, checkpoint.recurrent_states):
            layer.conv_state[slot].copy_(conv)
            layer.recurrent_state[slot].copy_(recurrent)
        tail = checkpoint.num_tokens % self.block_size
        if tail:
            block = request.block_table[checkpoint.num_tokens // self.block_size]
            for (k_cache, v_cache), (k, v) in zip(self.kv_caches, checkpoint.tail_kv):
                k_cache[block, :tail].copy_(k)
                v_cache[block, :tail].copy_(v)

    # -- save ------------------------------------------------------------------

    def after_forward(self, scheduled, last_hidden: torch.Tensor, snapshots: list | None = None) -> None:
        """After a step's forward, before its bookkeeping: keep each sequence's last hidden row, and save
        where a chunk ended on a checkpoint position, and each snapshot the step took inside a chunk.
        last_hidden: [S, hidden], one row per scheduled item; snapshots: ModelRunnerOutput.snapshots."""
        for i, item in enumerate(scheduled):
            if item.num_tokens == 0:
                continue
            request = item.request
            request.last_hidden = last_hidden[i]
            num_computed = request.num_computed_tokens + item.num_tokens
            if num_computed in request.checkpoint_positions:
                self.save(request, num_computed)
        for snapshot in snapshots or []:
            self.save(scheduled[snapshot.item].request, snapshot.num_tokens, snapshot)

    def on_finish(self, request: Request, status: RequestStatus) -> None:
        """The end of a turn, before the slot is freed: the state after the last token fed forward."""
        if self.save_turn_ends and status != RequestStatus.FINISHED_ABORTED and request.last_hidden is not None \
                and request.num_computed_tokens > 0 and not request.needs_prompt_logits:
            self.save(request, request.num_computed_tokens)

    def save(self, request: Request, num_tokens: int, snapshot=None) -> None:
        """The request's state after `num_tokens` tokens: its slot's, or a snapshot's taken inside a step."""
        ids = request.token_ids[:num_tokens]
        if self.pool.has(ids):
            return  # never twice for one boundary
        tail = num_tokens % self.block_size
        block = request.block_table[num_tokens // self.block_size] if tail else None
        tail_kv = [(k[block, :tail].clone(), v[block, :tail].clone()) if tail else (k[:0, 0], v[:0, 0])
                   for k, v in self.kv_caches]
        num_full = num_tokens // self.block_size
        self.kv_manager.update_hashes(request)
        if snapshot is None:
            slot = request.state_slot
            conv = [layer.conv_state[slot].clone() for layer in self.linear_states]
            recurrent = [layer.recurrent_state[slot].clone() for layer in self.linear_states]
            hidden = request.last_hidden.clone()
        else:
            conv, recurrent, hidden = snapshot.conv_states, snapshot.recurrent_states, snapshot.hidden
        self.pool.save(ids, Checkpoint(num_tokens, conv, recurrent, tail_kv, hidden,
                                       request.block_hashes[num_full - 1] if num_full else None))
