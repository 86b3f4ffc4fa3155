"""A tiny random-weight Qwen3.5 text checkpoint (Gated DeltaNet + gated full attention) with SmolLM2's tokenizer.

As in testing/tiny_models.py the output head is scaled so greedy choices are decisive. The zero-centred norms
(checkpoints store weight ~ 0, the layer uses 1 + weight), the gated norms and dt_bias start at constants in
transformers' init; they get noise here so a wrong convention cannot pass the parity tests.
"""

from pathlib import Path

import torch

TINY_QWEN3_5 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            partial_rotary_factor=0.25),
                    tie_word_embeddings=False)
HEAD_SCALE = 8.0
NORM_NOISE = 0.3


def make_tiny_qwen3_5(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Writes config.json, model.safetensors and the tokenizer files of a tiny Qwen3.5 text model to out_dir."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (out_dir / "model.safetensors").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    settings = {**TINY_QWEN3_5, **overrides}
    config = Qwen3_5TextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, **settings)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(NORM_NOISE * torch.randn_like(param))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
