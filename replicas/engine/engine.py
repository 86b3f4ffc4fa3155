"""Engine: one model, one KV pool, one scheduler; tokens in, deltas out. Synchronous.

    step():  scheduled = scheduler.schedule()
             output    = model_runner.run(scheduled)     sampled ids, their logprobs, prompt logprobs
             updated   = scheduler.postprocess(scheduled, output.token_ids)    grammars advanced here
             -> RequestOutput per updated request: detokenize, logprobs, end those that hit a stop string
             (a request whose grammar failed gets no delta: it goes to `failures`, for its stream)

The engine is not thread-safe: AsyncEngine owns it from one thread.
"""

from dataclasses import dataclass

import torch

from core.engine_config import EngineConfig
from core.messages import GenerateDelta, GenerateRequest, RequestError
from core.tokenizer import eos_token_ids, load_tokenizer
from replicas.cache.block_pool import BlockPool
from replicas.cache.checkpoints import CheckpointPool
from replicas.cache.host_tier import HostTier
from replicas.cache.kv_cache_manager import KVCacheManager
from replicas.cache.state_slots import StateSlotPool
from replicas.device import resolve_device, resolve_dtype
from replicas.engine.checkpointer import Checkpointer
from replicas.engine.migration import MigrationStats, engine_layout
from replicas.engine.model_runner import ModelRunner, ModelRunnerOutput
from replicas.engine.output import RequestOutput, TokenTexts, reasoning_end_token_id
from replicas.engine.phases import phase
from replicas.engine.retention import Retention
from replicas.engine.scheduler import Scheduler
from replicas.engine.vision_encoder import load_vision_encoder
from replicas.models.gated_deltanet import GatedDeltaNet, allocate_linear_states
from replicas.models.loader import load_model
from replicas.request.images import expand_images
from replicas.request.request import Request, RequestStatus
from replicas.sampling.grammar import GrammarManager
from replicas.sampling.logprobs import PositionLogprobs


@dataclass
class EngineStats:
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputation included)
    num_prompt_tokens_cached: int = 0  # prompt tokens served from the prefix cache (every admission)
    num_generated_tokens: int = 0
    num_steps: int = 0


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.model_config = load_model(config.model, self.dtype, self.device,
                                                     pack_weights=config.pack_weights,
                                                     int4_decode=config.int4_decode,
                                                     native=config.native_kernels,
                                                     batch_invariant=config.batch_invariant,
                                                     gguf_blocks=config.gguf_weights == "blocks")
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config, config.model)
        self.token_texts = TokenTexts(self.tokenizer)
        self.reasoning_end_id = reasoning_end_token_id(self.tokenizer)
        kv_caches, num_blocks = self._allocate_kv_caches()
        # Hybrid models: recurrent state per running sequence; a cached attention prefix is reused only
        # together with a state checkpoint at exactly its end (the linear layers cannot recompute it).
        self.is_hybrid = bool(getattr(self.model, "linear_attention_layers", None))
        linear_states = allocate_linear_states(self.model_config, config.max_num_seqs, self.dtype, self.device) \
            if self.is_hybrid else None
        self.block_pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        kv_manager = KVCacheManager(self.block_pool, config.block_size, reuse_blocks_alone=not self.is_hybrid)
        self.checkpointer = None
        if self.is_hybrid and config.enable_state_checkpoints and config.enable_prefix_caching:
            # With the native recurrent ops a step copies states out inside its chunks (no chunk ends there)
            snapshots = all(m.native is not None for m in self.model.modules() if isinstance(m, GatedDeltaNet))
            self.checkpointer = Checkpointer(CheckpointPool(config.checkpoint_bytes), kv_manager, kv_caches,
                                             linear_states, save_turn_ends=True, every=config.checkpoint_every,
                                             snapshots=snapshots)
        # Host tier: evicted blocks (and checkpoints) kept packed in host memory, restored on a hit; else None.
        self.host_tier = None
        if config.host_tier_bytes and config.enable_prefix_caching and (not self.is_hybrid or self.checkpointer):
            self.host_tier = HostTier(config.host_tier_bytes, config.host_tier_codec)
            self.host_tier.attach(self.block_pool, kv_caches)
            kv_manager.tier = self.host_tier
            if self.checkpointer is not None:
                self.checkpointer.attach_tier(self.host_tier)
        self.scheduler = Scheduler(kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   StateSlotPool(config.max_num_seqs) if self.is_hybrid else None, self.checkpointer)
        # Structured outputs: the bitmask covers the logits' width (the model's vocab_size, which may exceed
        # the tokenizer's); EOS ids end a grammar.
        self.num_threads = torch.get_num_threads()  # the step thread's (AsyncEngine sets it before building us)
        # Images (a checkpoint with a vision tower): the processor, the tower and its output cache; else None.
        self.vision = load_vision_encoder(config.model, self.dtype, config.encoder_cache_bytes)
        self.grammars = GrammarManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                       config.max_num_seqs, config.grammar_compile_threads)
        self.runner = ModelRunner(self.model, kv_caches, config.block_size, self.device, linear_states,
                                  self.grammars, self.vision, compile_step=config.compile_step)
        self.runner.snapshot_checkpoints = self.checkpointer is not None and self.checkpointer.snapshots
        self.runner.warm_up()  # the compiled step's graph, before the first request
        # What a conversation's state must match to move here (replicas/engine/migration.py), and what moved.
        self.layout = engine_layout(self)
        self.migration_stats = MigrationStats()
        # What the budgets allocated, in bytes (the replica reports them beside its resident memory).
        self.memory = {"num_weight_bytes": tensor_bytes([*self.model.parameters(), *self.model.buffers()]),
                       "num_kv_cache_bytes": tensor_bytes([t for pair in kv_caches for t in pair]),
                       "num_linear_state_bytes": tensor_bytes([t for state in linear_states or []
                                                               for t in (state.conv_state, state.recurrent_state)])}
        model_len = config.context_len(self.model_config.max_position_embeddings)
        # A request that fits the context must fit the pool alone, or it could never finish.
        self.max_model_len = min(model_len, num_blocks * config.block_size)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.origins: dict[str, GenerateRequest] = {}  # what the ingress sent, for retention at the end
        self.failures: list[tuple[str, RequestError]] = []  # requests failed mid-generation, for their streams
        self.retention = Retention(config.retain_token_ids, config.max_retained_tokens)
        self.stats = EngineStats()

    def _allocate_kv_caches(self):
        cfg = self.model_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        block_shape = (self.config.block_size, cfg.num_key_value_heads, head_dim)
        # Only full-attention layers have KV (a hybrid model's linear layers keep state slots instead).
        num_kv_layers = len(getattr(self.model, "full_attention_layers", range(cfg.num_hidden_layers)))
        bytes_per_block = 2 * num_kv_layers * torch.Size(block_shape).numel() * self.dtype.itemsize
        num_blocks = self.config.num_kv_blocks or self.config.kv_cache_bytes // bytes_per_block
        caches = [(torch.zeros((num_blocks, *block_shape), dtype=self.dtype, device=self.device),
                   torch.zeros((num_blocks, *block_shape), dtype=self.dtype, device=self.device))
                  for _ in range(num_kv_layers)]
        return caches, num_blocks  # per KV layer (k, v): [num_blocks, block_size, Hkv, D]

    # -- requests ---------------------------------------------------------

    def check_request(self, request: GenerateRequest, prompt_token_ids: list[int] | None = None) -> int:
        """Raises RequestError if the request can never run here; returns its resolved max_tokens."""
        prompt_token_ids = request.prompt_token_ids if prompt_token_ids is None else prompt_token_ids
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        images = request.images and self.vision is not None  # their tokens lie past the vocabulary
        if any(not 0 <= t < vocab for t in prompt_token_ids if not (images and t >= vocab)):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if images and request.sampling.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs are not available for prompts with images", param="prompt_logprobs")
        if any(not 0 <= t < vocab for t in request.sampling.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        spec = request.sampling.structured
        if spec is not None and any(not 0 <= t < vocab for t in spec.start_after or []):
            raise RequestError(f"start_after token ids must be in [0, {vocab})", param=spec.param)
        if num_prompt >= self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; "
                               f"the prompt has {num_prompt}.", param="prompt", code="context_length_exceeded")
        room = self.max_model_len - num_prompt
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; "
                               f"{num_prompt} in the prompt + {max_tokens} max_tokens exceed it.",
                               param="max_tokens", code="context_length_exceeded")
        return room if max_tokens is None else max_tokens

    def _share_cores(self) -> None:
        """While grammars compile on the pool, this step runs on fewer threads (GrammarManager.step_threads)."""
        want = self.grammars.step_threads(self.num_threads)
        if want != torch.get_num_threads():
            torch.set_num_threads(want)  # per thread under OpenMP: this is the step thread

    def add_request(self, request: GenerateRequest, grammar=None) -> None:
        """`grammar`: the request's compiled grammar, when its caller compiled it off this thread
        (AsyncEngine); else a structured request compiles here, blocking (or raises RequestError)."""
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already running", param="request_id")
        prompt, num_retained, retention = self.retention.resolve(request, self.max_model_len)
        prompt, images, to_expanded = self._expand_images(request, prompt)
        max_tokens = self.check_request(request, prompt)
        spec = request.sampling.structured
        if spec is not None and grammar is None:
            grammar = self.grammars.compile(spec)
        req = Request(request.request_id, prompt, request.sampling, max_tokens, self.eos_token_ids,
                      num_retained_tokens=num_retained, retention=retention, images=images)
        if spec is not None:
            req.grammar = self.grammars.new_state(spec, grammar)
        self.requests[req.request_id] = req
        self.origins[req.request_id] = request
        self.outputs[req.request_id] = RequestOutput(req, self.tokenizer, self.token_texts, self.reasoning_end_id)
        if self.checkpointer is not None:
            # The history boundary: where the kept ids end, or where the new messages start in the render.
            boundary = num_retained or to_expanded(request.new_turn_span[0] if request.new_turn_span else 0)
            self.checkpointer.plan(req, [boundary, *map(to_expanded, request.checkpoint_positions)])
        self.scheduler.add(req)

    def _expand_images(self, request: GenerateRequest, prompt: list[int]):
        """-> (the prompt with its images' tokens, the images, a map from positions in `prompt` to positions
        in the expanded one). Prompts without images pass through."""
        vision = self.vision
        if not request.images and (vision is None or vision.image_token_id not in prompt):
            return prompt, [], lambda p: p
        if vision is None:
            raise RequestError("messages: this model takes no images", param="messages")
        expanded, images = expand_images(prompt, request.images, vision, vision.image_token_id,
                                         self.model_config.vocab_size)
        # Placeholders (one token each, before expansion) sit at the images' starts less what earlier ones added.
        added, places = 0, []
        for image in images:
            places.append((image.span.start - added, image.span.num_tokens - 1))
            added += image.span.num_tokens - 1
        return expanded, images, lambda p: p + sum(extra for place, extra in places if place < p)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._forget(req)

    def _forget(self, req: Request) -> GenerateRequest:
        """Drops what the engine holds for a request that has finished; returns what the ingress sent."""
        del self.requests[req.request_id]
        del self.outputs[req.request_id]
        if req.grammar is not None:
            self.grammars.release(req.grammar)
            req.grammar = None
        return self.origins.pop(req.request_id)

    def take_failures(self) -> list[tuple[str, RequestError]]:
        """The requests that failed mid-generation since the last call, with why (their streams end so)."""
        failures, self.failures = self.failures, []
        return failures

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------

    def step(self) -> list[GenerateDelta]:
        with phase("schedule"):
            scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        for item in scheduled:
            num_prompt_left = item.request.num_prompt_tokens - item.request.num_computed_tokens
            self.stats.num_prompt_tokens_computed += max(0, min(item.num_tokens, num_prompt_left))
        self.stats.num_prompt_tokens_cached = self.scheduler.num_prompt_tokens_cached
        self._share_cores()
        output: ModelRunnerOutput = self.runner.run(scheduled)
        for item in scheduled:
            item.request.collected_prompt_logprobs += output.prompt_logprobs.get(item.request.request_id, [])
        with phase("output"):
            if self.checkpointer is not None:
                self.checkpointer.after_forward(scheduled, output.last_hidden, output.snapshots)
            updated = self.scheduler.postprocess(scheduled, output.token_ids)
            self.stats.num_steps += 1
            self.stats.num_generated_tokens += len(updated)
            # updated holds one request per sampling row, in the runner's row order.
            deltas = []
            for req, logprob in zip(updated, output.logprobs, strict=True):
                if req.error is not None:
                    self._forget(req)
                    self.failures.append((req.request_id, req.error))
                else:
                    deltas.append(self._delta(req, logprob))
        return deltas

    def _delta(self, req: Request, logprob: PositionLogprobs | None) -> GenerateDelta:
        out = self.outputs[req.request_id]
        token_id = req.token_ids[-1]
        out.add_token(req, token_id, logprob)
        if out.detokenizer.stopped:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        delta = out.delta(req, token_id)
        if req.status.is_finished:
            self.retention.record(self._forget(req), req.token_ids, out.detokenizer.text)
        return delta


def tensor_bytes(tensors) -> int:
    """Bytes held by distinct tensors (a tied weight counts once; packed oneDNN weights by their size)."""
    seen, total = set(), 0
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
