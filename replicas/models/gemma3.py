"""Gemma 3 text decoder (`Gemma3ForCausalLM`; the language model of `Gemma3ForConditionalGeneration`).

What differs from Llama (transformers' modeling_gemma3.py), each an exactness matter:
- every RMSNorm scales by (1 + weight) in float32 (ZeroCenteredRMSNorm), q and k too, per head;
- four norms per layer: input / post_attention around attention, pre_ / post_feedforward around the MLP,
  each post-norm applied to the branch before it joins the residual;
- GeGLU MLP (gelu_pytorch_tanh); embeddings times sqrt(hidden_size), rounded to the weights' dtype first;
- attention scale query_pre_attn_scalar^-0.5;
- local layers (sliding window, their own rope base) interleaved with global ones (`layer_types`; rope.py keys
  the RoPE parameters by layer type). A local layer's KV is kept whole; attention respects the window exactly
  (attention.py).
The residual stream stays in the weights' dtype, as transformers keeps it.
"""

import torch
from torch import nn

from replicas.models.attention import Attention
from replicas.models.forward_batch import ForwardBatch
from replicas.models.layers import SwiGLU, ZeroCenteredRMSNorm
from replicas.models.rope import RotaryEmbedding, check_rope

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        bias = bool(config.attention_bias)
        self.self_attn = Attention(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=ZeroCenteredRMSNorm,
                                   scale=config.query_pre_attn_scalar ** -0.5)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_activation)
        norm = lambda: ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, ropes: dict, x: torch.Tensor, kv_cache, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        h = self.self_attn(ropes[self.layer_type], self.input_layernorm(x), kv_cache, batch)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(config, config.max_position_embeddings, t)
                                     for t in sorted(set(config.layer_types))})
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, batch):
        embed = self.embed_tokens(input_ids)  # [T, hidden]
        x = embed * torch.tensor(self.embed_scale).to(embed.dtype)  # rounded as transformers rounds it
        ropes = {t: rotary.step_rope(positions) for t, rotary in self.rotary.items()}
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(ropes, x, kv_cache, batch)
        return self.norm(x)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        config = getattr(config, "text_config", None) or config  # Gemma3ForConditionalGeneration: its language model
        check_supported(config)
        self.config = config
        self.model = Gemma3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.tie_weights()

    def tie_weights(self) -> None:
        # Called again by the loader: moving off the meta device unties shared parameters.
        if getattr(self.config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, batch: ForwardBatch) -> torch.Tensor:
        # -> hidden states [T, hidden]; logits are computed only where a token is sampled.
        return self.model(input_ids, positions, kv_caches, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits [S, vocab] in float32
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A multimodal checkpoint's name -> ours; None for the vision weights, which are skipped. Both layouts:
        `language_model.model.layers...` (released) and `model.language_model.layers...` (transformers 5)."""
        if name.startswith(VISION_PREFIXES):
            return None
        if name.startswith("language_model."):
            return name.removeprefix("language_model.")
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name


def check_supported(config) -> None:
    for layer_type in set(config.layer_types):
        check_rope(config, layer_type)
    unknown = set(config.layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    if config.hidden_activation not in ("gelu_pytorch_tanh", "silu"):
        raise ValueError(f"activation {config.hidden_activation!r} is not supported")
