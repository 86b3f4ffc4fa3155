"""The Llama-shaped decoders: Llama 2/3.x (and SmolLM2), Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Phi-3/Phi-4-mini.

They differ by a few lines each, so they are one model here, its variations data (attention.py's table, the
MLP below, rope.py's scaling rules):
- Llama 3.x: llama3 RoPE scaling (rope.py), tied or untied embeddings;
- Mistral: a sliding window on every layer where the config sets one;
- Qwen2/2.5: bias on q/k/v; Qwen3: per-head RMSNorm on q and k, explicit head_dim;
- Qwen3-MoE: the sparse MoE MLP (moe.py) on its sparse layers (`decoder_sparse_step`, `mlp_only_layers`);
- Phi-3: fused qkv_proj / gate_up_proj weights (the loader takes a merged projection whole), partial rotary and
  longrope (rope.py).

Runs one step's flattened batch: `input_ids` [T] and `positions` [T] of every scheduled token of every
sequence, with the step's `ForwardBatch` describing where each token's KV goes (slot_mapping) and what it
attends to. Module names follow the checkpoint names, so loading is a name-for-name copy.
"""

import torch
from torch import nn

from replicas.models.attention import Attention
from replicas.models.forward_batch import ForwardBatch
from replicas.models.layers import RMSNorm, SwiGLU
from replicas.models.moe import SparseMoeBlock
from replicas.models.rope import RotaryEmbedding, StepRope, check_rope

# model_type -> what its attention adds to Llama's (attention.py's table)
FAMILIES = {"llama": {}, "mistral": {}, "phi3": {}, "qwen2": {"qkv_bias": True},
            "qwen3": {"qk_norm": RMSNorm}, "qwen3_moe": {"qk_norm": RMSNorm}}


def make_attention(config, layer_idx: int) -> Attention:
    bias = bool(getattr(config, "attention_bias", False))
    options = {"qkv_bias": bias, "o_bias": bias, **FAMILIES[config.model_type]}
    return Attention(config, layer_idx, **options)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Qwen3-MoE: layer i has the MoE MLP unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    return (getattr(config, "num_experts", 0) > 0 and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def make_mlp(config, layer_idx: int) -> nn.Module:
    if is_sparse_layer(config, layer_idx):
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", True)))
    return SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = make_attention(config, layer_idx)
        self.mlp = make_mlp(config, layer_idx)
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
        self.rotary = RotaryEmbedding(config, config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, batch):
        # The residual stream stays float32 whatever the weights' dtype: bf16 sums drift (the layers'
        # matmuls still run in the weights' dtype). -> [T, hidden] float32, for the float32 head.
        x = self.embed_tokens(input_ids).float()  # [T, hidden]
        rope = self.rotary.step_rope(positions)
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


def check_supported(config) -> None:
    if config.model_type not in FAMILIES:
        raise ValueError(f"model_type {config.model_type!r} is not a Llama-shaped family: {sorted(FAMILIES)}")
    check_rope(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"activation {config.hidden_act!r} is not supported ({config.model_type} uses silu)")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias is not supported (no released Llama-family checkpoint sets it)")
