"""GGUF metadata -> the HF config of its family (gguf_families.py), float32.

The keys every decoder has come first (`{arch}.block_count`, `.embedding_length`, ...); each family then adds
what its HF config needs and llama.cpp states elsewhere, often only in its C++ loader (src/models/<arch>.cpp):
- gemma3: which layers slide (`attention.sliding_window_pattern`, default 6: every 6th layer is global), the
  local rope base (`rope.freq_base_swa`, default 10000, unscaled), the attention scale;
- phi3: partial rotary (`rope.dimension_count` < head size), LongRoPE (gguf_rope.py), the sliding window;
- qwen3moe: the expert counts and size; the top-k weights are always renormalized (norm_w = true).
Anything the HF class cannot express exactly is refused with ValueError.
"""

import numpy as np
import torch
from gguf.quants import dequantize
from transformers import PretrainedConfig

from model_files.gguf_families import ROPE_FACTORS, ROPE_FREQS, family_of, has_experts
from model_files.gguf_rope import longrope_parameters, rope_parameters

GEMMA3_SWA_PATTERN = 6  # llama.cpp's default when the file has no sliding_window_pattern (gemma3.cpp)
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama_hparams.rope_freq_base_train_swa's default
GEMMA3_27B_LAYERS = 62  # gemma3.cpp: the 27B alone scales queries by (hidden / heads)^-0.5, not head_dim^-0.5


def read_config(field, arch: str, tensors: dict) -> PretrainedConfig:
    """A float32 HF config from the GGUF metadata (`field(key, default)` reads one key) and its
    tensors (name -> ReaderTensor: the vocabulary, a tied head, rope tensors)."""
    family = family_of(arch)
    if field(f"{arch}.expert_count", 0) and not has_experts(family):
        raise ValueError(f"mixture-of-experts GGUFs ({arch}.expert_count) are not supported for {arch}")
    hidden_size = field(f"{arch}.embedding_length")
    num_heads = field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.attention.key_length", hidden_size // num_heads)
    if field(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length differs from key_length; not supported")
    if not family.has_head_dim and head_dim != hidden_size // num_heads:
        raise ValueError(f"{family.hf_architecture} needs head_dim == hidden_size / num_heads; GGUF has {head_dim}")
    config = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [cols, rows]
        hidden_size=hidden_size,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", num_heads),
        max_position_embeddings=field(f"{arch}.context_length"),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
        architectures=[family.hf_architecture],
        dtype=torch.float32,
    )
    if family.has_head_dim:
        config["head_dim"] = head_dim
    config.update(FAMILY_KEYS.get(arch, full_rotary_keys)(field, arch, tensors, config))
    return family.config_class(**config)


def full_rotary_keys(field, arch: str, tensors: dict, config: dict) -> dict:
    """rope_parameters of a family that rotates whole heads, with one rope for every layer."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if field(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF rope.dimension_count differs from the head size (partial rotary); not supported")
    return dict(rope_parameters=rope_parameters(field, arch, head_dim, read_vector(tensors, ROPE_FREQS)))


def read_vector(tensors: dict, name: str) -> np.ndarray | None:
    """A 1-D config tensor (rope_freqs, rope factors) as float32, or None when absent."""
    tensor = tensors.get(name)
    return None if tensor is None else np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).ravel()


def gemma3_keys(field, arch: str, tensors: dict, config: dict) -> dict:
    """Gemma 3's layer types, per-type rope, attention scale and softcaps, as llama.cpp runs them."""
    if field(f"{arch}.attn_logit_softcapping"):
        raise ValueError("GGUF gemma3 with attention logit softcapping is not supported")
    num_layers, window = config["num_hidden_layers"], field(f"{arch}.attention.sliding_window", 0)
    if window:
        is_swa = sliding_layers(field(f"{arch}.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN), num_layers)
    else:  # llama.cpp: no window, no local layers
        is_swa = [False] * num_layers
    if num_layers == GEMMA3_27B_LAYERS:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    local_base = float(field(f"{arch}.rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE))
    return dict(
        layer_types=["sliding_attention" if s else "full_attention" for s in is_swa],
        sliding_window=window or None,
        query_pre_attn_scalar=query_pre_attn_scalar,
        final_logit_softcapping=field(f"{arch}.final_logit_softcapping") or None,
        rope_parameters={"full_attention": full_rotary_keys(field, arch, tensors, config)["rope_parameters"],
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},  # unscaled
        hidden_activation="gelu_pytorch_tanh",  # llama.cpp's gemma3 graph hard-codes its GELU
    )


def sliding_layers(pattern, num_layers: int) -> list[bool]:
    """llama_hparams::set_swa_pattern: a per-layer list as written, or every n-th layer global
    (layer i slides when i % n < n - 1; n = 0: every layer slides)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [bool(p) for p in pattern]
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]


def phi3_keys(field, arch: str, tensors: dict, config: dict) -> dict:
    """Phi-3's partial rotary, LongRoPE and window (Phi3MiniModel.set_gguf_parameters: window 0 means none)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = field(f"{arch}.rope.dimension_count", head_dim)
    original = field(f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
    long, short = (read_vector(tensors, name) for name in ROPE_FACTORS)
    rope = longrope_parameters(field, arch, head_dim, rotary_dim, long, short, config["max_position_embeddings"],
                               original)
    return dict(rope_parameters=rope, original_max_position_embeddings=int(original),
                sliding_window=field(f"{arch}.attention.sliding_window", 0) or None)


def qwen3moe_keys(field, arch: str, tensors: dict, config: dict) -> dict:
    """Qwen3-MoE: every layer sparse (llama.cpp's qwen3moe has no dense-layer form), softmax top-k renormalized."""
    used = field(f"{arch}.expert_used_count")
    size = field(f"{arch}.expert_feed_forward_length")
    if isinstance(size, list):  # per layer; HF has one size
        if len(set(size)) != 1:
            raise ValueError(f"GGUF expert_feed_forward_length differs per layer ({sorted(set(size))}); not supported")
        size = size[0]
    if size is None:  # qwen3moe.cpp's fallback
        size = config["intermediate_size"] // used
    return dict(num_experts=field(f"{arch}.expert_count"), num_experts_per_tok=used, moe_intermediate_size=size,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                **full_rotary_keys(field, arch, tensors, config))


FAMILY_KEYS = {"gemma3": gemma3_keys, "phi3": phi3_keys, "qwen3moe": qwen3moe_keys}
