"""Scheduler: decides which tokens of which requests the next step computes.

There is no "prefill phase" and "decode phase": every request has
`num_tokens` and `num_computed_tokens`, and a step gives each running request
up to the difference, under one token budget. Running requests go first, in
arrival order; waiting requests join between steps while the budget, the batch
capacity and the block pool allow, their prompts cut into chunks. A running
request that cannot get a block preempts the newest running request (its
blocks are freed and it is recomputed later: its token ids are kept, so the
output is unchanged). A request is never scheduled without its blocks.
"""

from collections import deque
from dataclasses import dataclass

from core.messages import RequestError
from replicas.cache.kv_cache_manager import KVCacheManager
from replicas.cache.state_slots import StateSlotPool
from replicas.request.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        # The step reaches the end of the known tokens, so it yields the next one.
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 state_slots: StateSlotPool | None = None, checkpointer=None):
        self.kv_manager = kv_manager
        self.state_slots = state_slots  # hybrid models only: one recurrent-state slot per running sequence
        self.checkpointer = checkpointer  # hybrid models only: restores on admission, saves at turn ends
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_cached = 0  # prompt tokens served from the prefix cache, every admission

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        # running
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget,
                             request.tokens_to_next_checkpoint())
            while not self.kv_manager.allocate_slots(request, num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    num_tokens = 0
                    break
            if num_tokens:
                scheduled.append(ScheduledRequest(request, num_tokens))
                budget -= num_tokens
                i += 1
        # waiting: a new (or preempted) request holds no blocks; admission reuses its cached prefix
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_tokens = self._admit(request, budget)
            if num_tokens is None:
                break
            self._count_cached(request)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
        return scheduled

    def _admit(self, request: Request, budget: int) -> int | None:
        if self.state_slots is not None:
            request.state_slot = self.state_slots.allocate()  # a restore copies state into it
        if self.checkpointer is not None:
            num_tokens = self.checkpointer.admit(request, budget)
        else:
            num_tokens = self.kv_manager.admit(request, min(budget, request.tokens_to_next_checkpoint()))
        if num_tokens is None and request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
        return num_tokens

    def _count_cached(self, request: Request) -> None:
        num_cached_prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached_prompt
        self.num_prompt_tokens_cached += num_cached_prompt

    def _release(self, request: Request) -> None:
        """Gives back what a request holds: its blocks, and its state slot (a state cannot be rewound)."""
        self.kv_manager.free(request)
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
        request.last_hidden = request.restored_hidden = None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def postprocess(self, scheduled: list[ScheduledRequest], sampled_token_ids: list[int]) -> list[Request]:
        """Advance the computed counts, append the sampled tokens (one per sampling row, in order),
        advance their grammars, finish what hit a stop token, its grammar's end or its length. Returns the
        requests that got a token (a request whose grammar refused its token carries `error`)."""
        sampled = iter(sampled_token_ids)
        updated = []
        for item in scheduled:
            request = item.request
            samples = item.samples
            request.num_computed_tokens += item.num_tokens
            self.kv_manager.cache_full_blocks(request)
            if not samples:
                continue
            token_id = next(sampled)
            request.token_ids.append(token_id)
            grammar = request.grammar
            if request.error is not None:  # the sampler could not draw for it (sampler.fail_empty_rows)
                self.finish(request, RequestStatus.FINISHED_ABORTED)
            elif grammar is not None and not grammar.advance(request.token_ids, request.num_prompt_tokens):
                # The mask allows only what the matcher accepts, so this is a bug; it ends this request only.
                request.error = RequestError(f"structured output: the grammar refused token {token_id}",
                                             status_code=500, type="internal_error")
                self.finish(request, RequestStatus.FINISHED_ABORTED)
            elif request.is_stop_token(token_id) or grammar is not None and grammar.is_terminated:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
            elif request.num_output_tokens >= request.max_tokens:
                self.finish(request, RequestStatus.FINISHED_LENGTH)
            updated.append(request)
        return updated

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request now (stop token, length, stop string, abort) and frees its blocks."""
        if request.status.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.checkpointer is not None and request.state_slot is not None:
            self.checkpointer.on_finish(request, status)  # the turn's end, while the slot still holds it
        self._release(request)
        request.status = status
