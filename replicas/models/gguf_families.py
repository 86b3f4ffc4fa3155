"""The GGUF architectures we convert: each one's HF class and config, tensor names, Q/K layout.

llama.cpp names a decoder's tensors alike for every architecture (blk.N.attn_q.weight, ...). What
differs is the extra tensors (Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorms), the HF class,
and the Q/K row order. llama.cpp's LlamaModel.permute regroups each head's Q/K rows into
interleaved pairs for its "normal" rope kernel, and only LlamaModel does it (`undo_permute = True`;
GGUF architecture "llama": Llama 2/3, SmolLM, and Mistral, which llama.cpp converts as llama).
Qwen2Model / Qwen3Model derive from TextModel and keep HF's row order; llama.cpp runs them with its
NEOX (halves) rope kernel, which is HF's convention already.
"""

from dataclasses import dataclass

import torch
from gguf.quants import dequantize
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from replicas.models.gguf_rope import rope_parameters

# GGUF tensor name -> HF checkpoint name. "{i}" is the layer index.
DECODER_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
QKV_BIASES = {
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
QK_NORMS = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
OPTIONAL_TENSORS = ("output.weight",)  # absent: the head is tied to the embedding
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, baked (gguf_rope.py); not a weight


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    config_class: type[PretrainedConfig]
    tensor_names: dict[str, str]
    permutes_qk: bool  # Q/K rows in llama.cpp's interleaved-pair order (undone in gguf.py)
    has_head_dim: bool  # the config takes head_dim; else it must be hidden_size / num_attention_heads
    has_rope_freqs: bool = False  # may carry rope_freqs.weight (llama.cpp's LlamaModel writes it for llama3 rope)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", LlamaConfig, DECODER_TENSORS, permutes_qk=True, has_head_dim=True,
                    has_rope_freqs=True),
    "qwen2": Family("Qwen2ForCausalLM", Qwen2Config, {**DECODER_TENSORS, **QKV_BIASES}, permutes_qk=False,
                    has_head_dim=False),
    "qwen3": Family("Qwen3ForCausalLM", Qwen3Config, {**DECODER_TENSORS, **QK_NORMS}, permutes_qk=False,
                    has_head_dim=True),
}


def family_of(arch: str | None) -> Family:
    if arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[arch]


def hf_names(family: Family, num_layers: int) -> dict[str, str]:
    """The family's tensor names with the layer index filled in for every layer."""
    names = {}
    for gguf_name, hf_name in family.tensor_names.items():
        for i in range(num_layers) if "{i}" in gguf_name else [None]:
            names[gguf_name.format(i=i)] = hf_name.format(i=i)
    return names


def read_config(field, arch: str, tensors: dict) -> PretrainedConfig:
    """A float32 HF config from the GGUF metadata (`field(key, default)` reads one key) and its
    tensors (name -> ReaderTensor: the vocabulary, a tied head, llama3 rope). Raises ValueError for
    what the HF class cannot express."""
    family = family_of(arch)
    if field(f"{arch}.expert_count", 0):
        raise ValueError(f"mixture-of-experts GGUFs ({arch}.expert_count) are not supported")
    hidden_size = field(f"{arch}.embedding_length")
    num_heads = field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.attention.key_length", hidden_size // num_heads)
    if field(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length differs from key_length; not supported")
    if field(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF rope.dimension_count differs from the head size (partial rotary); not supported")
    if not family.has_head_dim and head_dim != hidden_size // num_heads:
        raise ValueError(f"{family.hf_architecture} needs head_dim == hidden_size / num_heads; GGUF has {head_dim}")
    rope_freqs = tensors.get(ROPE_FREQS)
    rope_freqs = None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type)
    config = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [cols, rows]
        hidden_size=hidden_size,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", num_heads),
        max_position_embeddings=field(f"{arch}.context_length"),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_parameters=rope_parameters(field, arch, head_dim, rope_freqs),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
        architectures=[family.hf_architecture],
        dtype=torch.float32,
    )
    if family.has_head_dim:
        config["head_dim"] = head_dim
    return family.config_class(**config)
