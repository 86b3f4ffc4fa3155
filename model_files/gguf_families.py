"""The GGUF architectures we convert: each one's HF class, tensor names, and what llama.cpp changed in them.

llama.cpp names a decoder's tensors alike for every architecture (blk.N.attn_q.weight, ...; gguf-py's
constants.py TENSOR_NAMES). What differs per architecture, as convert_hf_to_gguf.py writes it:
- the extra tensors: Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k RMSNorms, Gemma 3's
  post-attention / post-FFN norms, Phi-3's fused attn_qkv and gate|up ffn_up (HF's own fused layout, kept
  whole: `self_attn.qkv_proj`, `mlp.gate_up_proj`), Qwen3-MoE's router and stacked experts
  (`ffn_*_exps` [E, rows, cols], written here as the hub's per-expert names);
- the Q/K row order. LlamaModel.permute regroups each head's Q/K rows into interleaved pairs for llama.cpp's
  "normal" rope kernel, and only LlamaModel does it (`undo_permute = True`; GGUF architecture "llama": Llama
  2/3, SmolLM, and Mistral, which llama.cpp converts as llama). The others derive from TextModel, keep HF's
  row order, and run with the NEOX (halves) kernel, which is HF's convention already;
- Gemma 3's norms: Gemma3Model.modify_tensors adds 1 to every tensor whose HF name ends in "norm.weight"
  (the layer norms, q/k norms and the final norm: llama.cpp multiplies by the weight, HF by 1 + weight);
- tensors that are config, not weights: Llama 3's rope_freqs, Phi-3's LongRoPE factors (gguf_rope.py).
"""

from dataclasses import dataclass

from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers import Qwen3MoeConfig

# GGUF tensor name -> HF checkpoint name. "{i}" is the layer index, "{e}" the expert's (a stacked tensor).
HEAD = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ATTENTION = {
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
}
MLP = {
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
DECODER_TENSORS = {**HEAD, **ATTENTION, **MLP}
QKV_BIASES = {
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
QK_NORMS = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
GEMMA3_NORMS = {  # llama.cpp's FFN_PRE_NORM is named ffn_norm, as other families' post-attention norm
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
PHI3_FUSED = {  # attn_qkv rows: [q | k | v]; ffn_up rows: [gate | up] (ggml_swiglu gates with the first half)
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}
EXPERTS = {  # stacked: [E, I, H] for gate / up, [E, H, I] for down; the router [E, H]
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
OPTIONAL_TENSORS = ("output.weight",)  # absent: the head is tied to the embedding
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, baked (gguf_rope.py)
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE (gguf_rope.py)


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    config_class: type[PretrainedConfig]
    tensor_names: dict[str, str]
    permutes_qk: bool  # Q/K rows in llama.cpp's interleaved-pair order (undone in gguf.py)
    has_head_dim: bool  # the config takes head_dim; else it must be hidden_size / num_attention_heads
    config_tensors: tuple[str, ...] = ()  # may be present; read into config.json (rope), not weights
    norm_shift: float = 0.0  # llama.cpp added this to every *norm.weight (Gemma: HF's 1 + weight)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", LlamaConfig, DECODER_TENSORS, permutes_qk=True, has_head_dim=True,
                    config_tensors=(ROPE_FREQS,)),
    "qwen2": Family("Qwen2ForCausalLM", Qwen2Config, {**DECODER_TENSORS, **QKV_BIASES}, permutes_qk=False,
                    has_head_dim=False),
    "qwen3": Family("Qwen3ForCausalLM", Qwen3Config, {**DECODER_TENSORS, **QK_NORMS}, permutes_qk=False,
                    has_head_dim=True),
    "qwen3moe": Family("Qwen3MoeForCausalLM", Qwen3MoeConfig,
                       {**HEAD, **ATTENTION, **QK_NORMS, "blk.{i}.ffn_norm.weight": MLP["blk.{i}.ffn_norm.weight"],
                        **EXPERTS}, permutes_qk=False, has_head_dim=True),
    "gemma3": Family("Gemma3ForCausalLM", Gemma3TextConfig, {**DECODER_TENSORS, **QK_NORMS, **GEMMA3_NORMS},
                     permutes_qk=False, has_head_dim=True, norm_shift=1.0),
    "phi3": Family("Phi3ForCausalLM", Phi3Config,
                   {**HEAD, "blk.{i}.attn_norm.weight": ATTENTION["blk.{i}.attn_norm.weight"],
                    "blk.{i}.attn_output.weight": ATTENTION["blk.{i}.attn_output.weight"],
                    "blk.{i}.ffn_norm.weight": MLP["blk.{i}.ffn_norm.weight"],
                    "blk.{i}.ffn_down.weight": MLP["blk.{i}.ffn_down.weight"], **PHI3_FUSED},
                   permutes_qk=False, has_head_dim=False, config_tensors=ROPE_FACTORS),
}


def family_of(arch: str | None) -> Family:
    if arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[arch]


def has_experts(family: Family) -> bool:
    return any("{e}" in name for name in family.tensor_names.values())


def hf_names(family: Family, num_layers: int) -> dict[str, str]:
    """The family's tensor names with the layer index filled in for every layer ("{e}" is left for
    gguf.py to fill per expert)."""
    names = {}
    for gguf_name, hf_name in family.tensor_names.items():
        for i in range(num_layers) if "{i}" in gguf_name else [None]:
            names[gguf_name.replace("{i}", str(i))] = hf_name.replace("{i}", str(i))
    return names
