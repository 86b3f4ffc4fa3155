"""Self-attention over the paged KV cache, as the Llama-shaped families have it.

One module for Llama, Mistral, Qwen2/3 (dense and MoE), Phi-3 and Gemma 3; what differs is data:

    family       q/k/v bias   o bias   q/k norm             window                      scale
    llama        attention_bias (both) -                    -                           head_dim^-0.5
    mistral      -            -        -                    sliding_window, every layer head_dim^-0.5
    qwen2        yes          -        -                    sliding layers (layer_types) head_dim^-0.5
    qwen3(_moe)  attention_bias (both) RMSNorm per head     sliding layers / every layer head_dim^-0.5
    phi3         -            -        -                    sliding_window, every layer head_dim^-0.5
    gemma3       attention_bias (both) (1 + w) per head     sliding layers              query_pre_attn_scalar^-0.5

The window follows transformers' convention: query at position p sees key j when p - j < sliding_window. The
KV of a sliding layer is kept whole (every block of the sequence), the attention op skips the keys outside the
window; so prefix caching and retention work unchanged, at the memory of a global layer.
"""

import torch
from torch import nn

from replicas.kernels.paged_attention import paged_attention, store_kvcache
from replicas.models.forward_batch import ForwardBatch
from replicas.models.layers import MergedLinear
from replicas.models.rope import StepRope


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_window(config, layer_idx: int) -> int:
    """The sliding window of layer `layer_idx` (0: global). Configs with `layer_types` (Qwen2/3, Gemma 3) slide
    only their "sliding_attention" layers; the others (Mistral, Phi-3, Qwen3-MoE) every layer."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else 0
    return window


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: type[nn.Module] | None = None, scale: float | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = scale or self.head_dim ** -0.5
        self.sliding_window = layer_window(config, layer_idx)
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Loads q_proj / k_proj / v_proj into their rows, or a fused qkv_proj (Phi-3) whole.
        self.qkv_proj = MergedLinear(config.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                     bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps)
        self.has_qk_norm = qk_norm is not None

    def forward(self, rope: StepRope, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(num_tokens, -1, self.head_dim)  # [T, H + Hkv, D]
        if self.has_qk_norm:  # per head, before rotary
            qk = torch.cat((self._norm(self.q_norm, qk[:, :self.num_heads]),
                            self._norm(self.k_norm, qk[:, self.num_heads:])), dim=1)
        qk = rope.rotate(qk)  # q and k adjacent: one rotation for both
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping, native=batch.groups is None)
        o = paged_attention(q, k_cache, v_cache, batch, self.scale, self.sliding_window, self.softcap)  # [T, H, D]
        return self.o_proj(o.reshape(num_tokens, -1))

    @staticmethod
    def _norm(norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        # heads: [T, n, D] -> normed [T, n, D]; rows of D, so the fused 2-D op applies
        return norm(heads.reshape(-1, heads.shape[-1])).view(heads.shape)
