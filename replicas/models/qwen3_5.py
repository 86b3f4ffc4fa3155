"""Qwen3.5 text decoder (model_type `qwen3_5_text`): a hybrid of Gated DeltaNet and gated full attention; and
Qwen3.5-MoE (`qwen3_5_moe_text`), the same hybrid with the sparse MoE MLP and its gated shared expert (moe.py).

`config.layer_types` names each layer "linear_attention" (GatedDeltaNet, state in slots outside the module:
replicas/models/gated_deltanet.py) or "full_attention" (gated attention on our paged KV cache, as Llama's).
Runs one step's flattened batch, `input_ids` [T] and `positions` [T]; `kv_caches` holds one (k, v) per
FULL-attention layer, in layer order, and `linear_state` one LinearLayerState per linear layer.

Differences from Llama that matter for exactness (transformers' modeling_qwen3_5.py):
- every RMSNorm except the gated one scales by (1 + weight), in float32, then casts;
- q_proj gives query and output gate per head ([T, H, 2 * D] split in halves); out = o * sigmoid(gate);
- q_norm / k_norm per head before rotary; rotary on the first head_dim * partial_rotary_factor dims only
  (text positions: the three mrope sections carry the same position, so it is plain rotate-half RoPE).
Module names follow Qwen3_5ForCausalLM's state dict (`model.layers.{i}.linear_attn.in_proj_qkv.weight`, ...).
"""

import torch
from torch import nn

from replicas.kernels.paged_attention import paged_attention, store_kvcache
from replicas.models.forward_batch import ForwardBatch
from replicas.models.gated_deltanet import GatedDeltaNet, LinearStateBatch
from replicas.models.layers import SwiGLU, ZeroCenteredRMSNorm
from replicas.models.moe import SparseMoeBlock
from replicas.models.mrope import mrope_columns, mrope_sections
from replicas.models.rope import RotaryEmbedding, StepRope, check_rope


class Qwen3_5Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = bool(config.attention_bias)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)  # query and gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, rope: StepRope, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        q, gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, H, D]
        k = self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate(q), rope.rotate(k)  # the first rotary_dim dims of each head
        k_cache, v_cache = kv_cache
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping, native=batch.groups is None)
        o = paged_attention(q, k_cache, v_cache, batch, self.scale)  # [T, H, D]
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(num_tokens, -1))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Qwen3_5Attention(config)
        self.mlp = make_mlp(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: StepRope, x, batch: ForwardBatch, kv_cache=None, linear_state=None,
                step: LinearStateBatch | None = None, snapshot=None):
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch.cu_seqlens, linear_state, step, snapshot)
        else:
            h = self.self_attn(rope, h, kv_cache, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary = RotaryEmbedding(config, config.max_position_embeddings)  # partial: rotary_dim < head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, t) for t in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mrope_sections = mrope_sections(config)  # images: the rotary's (t, h, w) layout

    def forward(self, input_ids, positions, kv_caches, batch, linear_state: LinearStateBatch | None):
        x = self.embed(input_ids, batch)  # [T, hidden]
        rope = self.rotary.step_rope(positions) if batch.mrope_positions is None else \
            self.rotary.step_mrope(batch.mrope_positions, mrope_columns(self.rotary.rotary_dim, self.mrope_sections))
        kv_iter = iter(kv_caches)
        state_iter = iter(zip(linear_state.layers, linear_state.snapshots)) if linear_state is not None else None
        for layer in self.layers:
            if layer.is_linear:
                layer_state, snapshot = next(state_iter) if state_iter is not None else (None, None)
                x = layer(rope, x, batch, linear_state=layer_state, step=linear_state, snapshot=snapshot)
            else:
                x = layer(rope, x, batch, kv_cache=next(kv_iter))
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Token embeddings [T, hidden]; an image's tokens (ids past the vocabulary, one value per image:
        replicas/request/images.py) take their vision features instead."""
        if batch.image_embeds is None:
            return self.embed_tokens(input_ids)
        rows, features = batch.image_embeds  # [K], [K, hidden]
        x = self.embed_tokens(input_ids.index_fill(0, rows, 0))
        return x.index_copy_(0, rows, features.to(x.dtype))


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        config = getattr(config, "text_config", None) or config  # Qwen3_5ForConditionalGeneration: its text model
        check_supported(config)
        self.config = config
        self.model = Qwen3_5TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Which layers need a KV cache and which need state slots, in layer order.
        self.full_attention_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        self.linear_attention_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
        self.tie_weights()

    def tie_weights(self) -> None:
        # Called again by the loader: moving off the meta device unties shared parameters.
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, batch: ForwardBatch,
                linear_state: LinearStateBatch | None = None) -> torch.Tensor:
        """-> hidden states [T, hidden]. kv_caches: one (k, v) per full-attention layer. linear_state: the step's
        slots, read and updated in place; None: every sequence starts from zeros and no state is kept."""
        return self.model(input_ids, positions, kv_caches, batch, linear_state)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A Qwen3_5ForConditionalGeneration checkpoint's name -> ours (`model.language_model.` -> `model.`);
        None for the vision tower's, which replicas/models/qwen3_5_vision.py loads."""
        if name.startswith(("model.visual.", "visual.")):
            return None
        return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") \
            else name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits [S, vocab] in float32
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()  # the head may be float32


def make_mlp(config) -> nn.Module:
    """Qwen3.5: SwiGLU; Qwen3.5-MoE: the sparse MoE MLP with its gated shared expert, on every layer."""
    if getattr(config, "num_experts", 0):
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", True)),
                              config.shared_expert_intermediate_size)
    return SwiGLU(config.hidden_size, config.intermediate_size)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text checkpoints (model_type qwen3_5_moe_text): the same hybrid, the MoE MLP (make_mlp)."""


def check_supported(config) -> None:
    check_rope(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"activation {config.hidden_act!r} is not supported (Qwen3.5 uses silu)")
    unknown = set(config.layer_types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError("layer_types must name every layer")
