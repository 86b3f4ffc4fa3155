"""Tiny random-weight checkpoints of every supported family, each with its distinguishing features on.

Built from the family's own `transformers` config class (small sizes, 2-4 layers), saved with save_pretrained
(so the checkpoint names are the released ones: per-expert MoE weights, Phi-3's fused projections, Gemma 3's
multimodal nesting), with the family's tokenizer (testing/family_tokenizers.py: SmolLM2's vocabulary plus the
family's special tokens, its eos, its published chat template).

As in testing/tiny_models.py the output head is scaled so greedy choices are decisive; norms that start at a
constant get noise, so a wrong convention cannot pass the parity tests.
"""

from pathlib import Path

import torch

HEAD_SCALE = 8.0
NORM_NOISE = 0.3
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)
TEST_WINDOW = 16  # sliding windows shorter than the test prompts (37 tokens)

# family -> (transformers config class, model class, config settings, the family whose tokenizer it uses)
FAMILIES = {
    # llama3 rope scaling with a short original context: the smoothed and the scaled frequencies both occur
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        SMALL, head_dim=16, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)), "llama3"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SMALL, tie_word_embeddings=False), "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(SMALL, head_dim=32, tie_word_embeddings=True), "qwen3"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        SMALL, num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False), "qwen3"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        SMALL, num_hidden_layers=4, head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)), "qwen3_5"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        SMALL, head_dim=16, sliding_window=TEST_WINDOW, tie_word_embeddings=False), "mistral"),
    # local layers (window, base 10k) around a global one (base 1M, linear scaling as the 4B+ checkpoints have)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        SMALL, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=TEST_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)},
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True), "gemma3"),
    # partial rotary as Phi-4-mini (0.75), LongRoPE with its per-dimension short / long factors
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        SMALL, max_position_embeddings=512, original_max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             original_max_position_embeddings=128,
                             short_factor=[1.0 + 0.1 * i for i in range(6)],
                             long_factor=[1.0 + 0.9 * i for i in range(6)])), "phi3"),
}


def family_config(family: str, tokenizer, **overrides):
    import transformers

    config_class, _, settings, _ = FAMILIES[family]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    return getattr(transformers, config_class)(vocab_size=len(tokenizer), **ids, **{**settings, **overrides})


def make_tiny_family(family: str, out_dir: Path, base_tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Writes config.json, model.safetensors and the family's tokenizer files to out_dir (once)."""
    import transformers
    from transformers import AutoTokenizer

    from testing.family_tokenizers import make_family_tokenizer

    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    make_family_tokenizer(FAMILIES[family][3], base_tokenizer_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    config = family_config(family, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config).float()
    _decisive(model)
    model.save_pretrained(str(out_dir))
    _stop_tokens(FAMILIES[family][3], tokenizer, out_dir)
    return out_dir


def make_tiny_gemma3_multimodal(out_dir: Path, base_tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the text model), as the 4B+
    checkpoints ship: we load its language model and skip the vision weights."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from testing.family_tokenizers import make_family_tokenizer

    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    make_family_tokenizer("gemma3", base_tokenizer_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=family_config("gemma3", tokenizer).to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).float()
    _decisive(model)
    model.save_pretrained(str(out_dir))
    _stop_tokens("gemma3", tokenizer, out_dir)
    return out_dir


def _stop_tokens(tokenizer_family: str, tokenizer, out_dir: Path) -> None:
    """generation_config.json lists every stop token, as the released checkpoints do (Llama 3.x's <|eot_id|>,
    <|end_of_text|>, <|eom_id|>; Gemma 3's <end_of_turn> and <eos>)."""
    from transformers import GenerationConfig

    from testing.family_tokenizers import FAMILY_TOKENS

    names = [FAMILY_TOKENS[tokenizer_family]["eos"], *FAMILY_TOKENS[tokenizer_family]["other_eos"]]
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids(names),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out_dir))


def _decisive(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(NORM_NOISE * torch.randn_like(param))
