"""Structured outputs (xgrammar): grammars compiled off the step thread, a matcher per sequence, the bitmask.

    admission    GrammarManager.submit(spec) -> Future[CompiledGrammar]: on a thread pool, shared by the
                 requests that ask for the same spec, LRU-cached. AsyncEngine.generate awaits it before the
                 request reaches the engine, so the scheduler never waits on a compilation; an invalid spec
                 fails there: RequestError 400 naming spec.param, before the first delta.
    add_request  GrammarManager.new_state(spec, compiled) -> GrammarState, held on Request.grammar.
    each step    Sampler: GrammarManager.apply(logits, batch) fills the bitmask rows of the sequences whose
                 grammar is active and sets their disallowed logits to -inf in place, BEFORE the logits
                 processors (so logprobs see the mask); grammar_end_wins keeps min_tokens from emptying a row.
    postprocess  GrammarState.advance(...): the matcher consumes the new output ids; a terminated matcher
                 (it took an end token) finishes the request with "stop".

End tokens are the engine's EOS ids: the mask allows them only where the grammar may end, and the matcher
terminates on one (so a grammar's output ends with EOS also under ignore_eos).

A batch with no live grammar pays one counter check: nothing per sequence.
"""

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from core.messages import STRUCTURED_KINDS, RequestError, StructuredSpec
from replicas.kernels import fused_cpu

# Compiled grammars kept (LRU, by spec). A big JSON schema's token-mask cache is a few MB at most.
MAX_CACHED_GRAMMARS = 256
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:15:57] /project/cpp/x.cc:94: "

_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice", "grammar": "grammar (EBNF)", "structural_tag": "structural tag"}


class GrammarState:
    """One sequence's matcher. Invariant: the state has seen exactly the request's output ids, and the
    matcher has consumed those after `start_after` (all of them without it)."""

    def __init__(self, compiled: xgr.CompiledGrammar, start_after: list[int] | None):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.start_after = list(start_after or [])
        self.is_active = not self.start_after
        self.num_seen = 0  # output ids seen, before the start marker included

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Consumes the output ids (token_ids[num_prompt_tokens:]) not seen yet; False when the grammar refuses
        one (the state is then unusable). Fewer output ids than seen (tokens taken back): rebuilt from the ids."""
        num_output = len(token_ids) - num_prompt_tokens
        if num_output < self.num_seen:
            self.matcher.reset()
            self.is_active = not self.start_after
            self.num_seen = 0
        while self.num_seen < num_output:
            token_id = token_ids[num_prompt_tokens + self.num_seen]
            self.num_seen += 1
            if self.is_active:
                if not self.matcher.accept_token(token_id):
                    return False
            else:
                k = len(self.start_after)
                end = num_prompt_tokens + self.num_seen
                self.is_active = self.num_seen >= k and token_ids[end - k:end] == self.start_after
        return True


class GrammarManager:
    """Owns the compiler (built on first use: an engine that never sees a grammar never pays for the
    tokenizer scan), the compile pool, the compiled-grammar cache and the step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, end_token_ids, max_num_seqs: int, num_threads: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed len(tokenizer)
        self.end_token_ids = sorted(end_token_ids)
        self.num_threads = num_threads
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tether-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)  # [S, ceil(V / 32)] int32, host
        self.num_live = 0  # GrammarStates of requests in the engine; 0: the sampler skips this stage
        self.num_compiling = 0  # compilations running on the pool now (the step leaves each a core)

    # -- compilation (any thread) --------------------------------------------

    def submit(self, spec: StructuredSpec) -> Future:
        """The spec's compiled grammar, compiling on the pool unless cached or under way. The future raises
        RequestError (400, param=spec.param) for an invalid spec."""
        key = spec.cache_key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and not future.cancelled():  # compiled, under way, or failed (for good)
                self._compiled.move_to_end(key)
                return future
            future = self.pool.submit(self._compile, spec)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """Blocking: for callers that own no event loop (the synchronous Engine, tests)."""
        return self.submit(spec).result()

    def _compiler_once(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.end_token_ids)
                # Our own cache keys by spec; xgrammar's would hold every grammar a second time.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        if spec.kind not in STRUCTURED_KINDS:
            raise RequestError(f"{spec.param}: unknown structured output kind {spec.kind!r}", param=spec.param)
        compiler = self._compiler_once()
        with self._lock:
            self.num_compiling += 1
        try:
            # Grammar first, then compile_grammar: xgrammar's compile_json_schema holds the GIL for most of a
            # compilation (a 260 ms schema stalled a Python thread beside it for 170 ms, in runs of up to 37 ms:
            # the step thread's), while these two calls release it.
            return compiler.compile_grammar(self._grammar(spec))
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own, with a C++ log prefix
            reason = _XGRAMMAR_LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            raise RequestError(f"{spec.param}: invalid {_WHAT[spec.kind]}: {reason or type(exc).__name__}",
                               param=spec.param) from None
        finally:
            with self._lock:
                self.num_compiling -= 1

    def step_threads(self, num_threads: int) -> int:
        """The threads a step may use out of `num_threads` now: one fewer per compilation under way, at
        least one. A compile thread beside a full OpenMP team takes a core the team's barrier waits on
        (through Serve on 2 cores, 4 streams' steps took 94-114 ms instead of ~20 while a 300-object schema
        compiled); a team one thread smaller runs at its own pace beside it. Lower priorities were worse:
        a nice-19 or idle-class compile thread that holds the GIL when a step thread preempts it stalls
        that step until a core falls idle, and waits seconds for the host to quiet down."""
        return max(1, num_threads - self.num_compiling)

    @staticmethod
    def _grammar(spec: StructuredSpec) -> xgr.Grammar:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(schema, any_whitespace=spec.any_whitespace, strict_mode=True)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choices))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
        return xgr.Grammar.from_structural_tag(spec.text)

    # -- sequences (the step thread) -------------------------------------------

    def new_state(self, spec: StructuredSpec, compiled: xgr.CompiledGrammar) -> GrammarState:
        self.num_live += 1
        return GrammarState(compiled, spec.start_after)

    def release(self, state: GrammarState) -> None:
        self.num_live -= 1

    def apply(self, logits: torch.Tensor, batch: list) -> list[int]:
        """Masks, in place, the rows whose grammar is active; returns them. logits: [R, V] float32, row r is
        batch[r]'s, a SamplingRow (batch.py; R <= max_num_seqs: each running sequence samples at most once a
        step)."""
        rows = [r for r, row in enumerate(batch) if row.grammar is not None and row.grammar.is_active]
        if not rows:
            return rows
        for r in rows:
            batch[r].grammar.matcher.fill_next_token_bitmask(self.bitmask, r)
        if logits.device.type == "cpu" and fused_cpu.fused_ops() is not None:  # ~2 us a row, xgrammar's ~180
            fused_cpu.apply_token_bitmask_(logits, self.bitmask, rows)
            return rows
        bitmask = self.bitmask[:logits.shape[0]].to(logits.device, non_blocking=True)  # [R, ceil(V / 32)]
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        return rows

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def grammar_end_wins(processed: torch.Tensor, masked: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Where the processors (min_tokens' ban on end tokens) left a grammar row no token at all, the grammar
    has nothing but its end to offer: that row takes the masked logits alone, so no row is all -inf.
    processed, masked: [R, V]; rows: the masked rows. Modifies `processed` (the processors' own copy)."""
    index = torch.tensor(rows, dtype=torch.int64, device=processed.device)
    empty = index[processed.index_select(0, index).amax(dim=-1) == float("-inf")]
    if empty.numel():
        processed[empty] = masked[empty]
    return processed


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose whole output is exactly one of `choices`. JSON string literals are valid EBNF literals
    (same escapes), so quotes, backslashes and newlines in a choice need no care."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
