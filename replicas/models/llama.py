"""Llama-family decoder (SmolLM2, Llama 2/3 without rope scaling): RoPE, GQA, RMSNorm, SwiGLU.

Runs one step's flattened batch: `input_ids` [T] and `positions` [T] of every
scheduled token of every sequence, with the step's `ForwardBatch` describing
where each token's KV goes (slot_mapping) and what it attends to (groups).
Module names follow the checkpoint names, so loading is a name-for-name copy.
"""

import torch
from torch import nn

from replicas.kernels.paged_attention import paged_attention, store_kvcache
from replicas.models.forward_batch import ForwardBatch
from replicas.models.layers import MergedLinear, RMSNorm, RotaryEmbedding, StepRope, SwiGLU


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                     bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, rope: StepRope, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        # q and k are adjacent in qkv: one rotation for both.
        qk = rope.rotate(qkv[:, :qk_width].view(num_tokens, -1, self.head_dim))  # [T, H + Hkv, D]
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping, native=batch.groups is None)
        o = paged_attention(q, k_cache, v_cache, batch, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(num_tokens, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: StepRope, x: torch.Tensor, pending: torch.Tensor | None, kv_cache, batch):
        """x: the float32 residual stream [T, hidden], updated in place; pending: the previous layer's MLP
        output, not yet added (None before the first layer): each add is fused into the norm that follows
        it. -> (x, this layer's MLP output)"""
        h = self.input_layernorm(x) if pending is None else self.input_layernorm(pending, residual=x)
        h = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, batch), residual=x)
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta(config))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, batch):
        # The residual stream stays float32 whatever the weights' dtype: bf16 sums drift (the layers'
        # matmuls still run in the weights' dtype). -> [T, hidden] float32, for the float32 head.
        x = self.embed_tokens(input_ids).float()  # [T, hidden]
        rope = self.rotary.step_rope(positions, native=self.norm.native)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, pending = layer(rope, x, pending, kv_cache, batch)
        return self.norm(pending, out_dtype=torch.float32, residual=x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_supported(config)
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # Called again by the loader: moving off the meta device unties shared parameters.
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, batch: ForwardBatch) -> torch.Tensor:
        # -> hidden states [T, hidden]; logits are computed only where a token is sampled.
        return self.model(input_ids, positions, kv_caches, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits [S, vocab] in float32
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()  # the head may be float32


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def check_supported(config) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope scaling {rope_type!r} is not supported yet")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"activation {config.hidden_act!r} is not supported (Llama uses silu)")
