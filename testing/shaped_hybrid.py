"""Random-weight Qwen3.5 text checkpoints with the shapes of published models, for the hybrid benchmarks
(bench/models/shaped_hybrid.py writes them once into the cache, with a GGUF for llama.cpp).

QWEN3_5_0_8B is the text model of Qwen/Qwen3.5-0.8B, the smallest published Qwen3.5, from its config.json
(`text_config`): 24 layers of 3 Gated DeltaNet to 1 gated attention, hidden 1024, SwiGLU 3584, attention 8 query
/ 2 KV heads of 256 with a quarter of each rotated (interleaved M-RoPE sections 11/11/10, theta 1e7), linear
attention 16 key and 16 value heads of 128 with a width-4 conv, a 248,320-token vocabulary, tied embeddings.
QWEN3_5_MOE_SMALL keeps Qwen/Qwen3.5-35B-A3B's layer pattern, head layout (16 key / 32 value linear heads of 128;
16 / 2 attention heads of 256) and MoE form (8 routed experts per token of 512 wide, a gated shared expert of
512) at the 0.8B's width and depth with 32 experts in place of 256, so it fits a laptop: ~1.5 B parameters.

The tokenizer is SmolLM2's (no hub here): ids past its 49,152 tokens exist in the vocabulary as they do in the
published checkpoint, with embedding rows 100x smaller than the rest, so greedy decoding never picks one and
every reply decodes to text. Weights are bf16, as published; norms and dt_bias get noise as in
testing/tiny_hybrid.py.
"""

from pathlib import Path

import torch

_ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
             mrope_interleaved=True)
_LAYOUT = dict(hidden_size=1024, num_hidden_layers=24, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
               num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6, rope_parameters=_ROPE,
               tie_word_embeddings=True, vocab_size=248320, full_attention_interval=4)

SHAPES = {
    "qwen3_5-0.8b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**_LAYOUT, "intermediate_size": 3584}),
    "qwen3_5-moe-small": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        **_LAYOUT, "num_attention_heads": 16, "linear_num_value_heads": 32, "num_experts": 32,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}),
}
PAD_ROW_SCALE = 0.01
NORM_NOISE = 0.3


def make_shaped_hybrid(out_dir: Path, tokenizer_dir: Path, shape: str, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors (bf16) and the tokenizer files to out_dir, unless they exist."""
    import transformers
    from transformers import AutoTokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    config_class, model_class, settings = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = getattr(transformers, config_class)(bos_token_id=tokenizer.bos_token_id,
                                                 eos_token_id=tokenizer.eos_token_id, **settings)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a 1-2 B model initialised in bf16: half the memory and time
    try:
        model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.get_input_embeddings().weight[len(tokenizer):].mul_(PAD_ROW_SCALE)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(NORM_NOISE * torch.randn_like(param))
    model.config.dtype = torch.bfloat16
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
