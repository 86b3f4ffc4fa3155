"""Tiny random-weight checkpoints with SmolLM2's tokenizer and chat template.

The output head is scaled so that greedy choices are decisive: logits of
neighbouring candidates differ by far more than float noise, and token-for-token
comparisons (batched vs alone, chunked vs whole) do not flip on near-ties.
"""

from pathlib import Path

import torch

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)
HEAD_SCALE = 8.0


def make_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Writes config.json, model.safetensors and the tokenizer files of a tiny Llama to out_dir."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out_dir / "model.safetensors").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **{**TINY_LLAMA, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def with_chat_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A view of model_dir (weights and config linked) whose tokenizer has another chat template."""
    from core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    for name in ("config.json", "model.safetensors"):
        (out_dir / name).symlink_to(model_dir / name)
    return out_dir
