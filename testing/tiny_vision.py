"""A tiny random-weight Qwen3.5 vision-language checkpoint (Qwen3_5ForConditionalGeneration): the hybrid text
model of testing/tiny_hybrid.py with 2 linear + 2 full attention layers, and a 2-block vision tower.

Its preprocessor_config.json keeps images small (at most 64 merged tokens). Without a tokenizer the vocab is
512 and the vision tokens take fixed ids below it (TINY_VL_TOKEN_IDS); given a tokenizer directory, the four
Qwen vision tokens are added to that tokenizer as special tokens and the ids are theirs (read them back from
config.json). As in testing/tiny_hybrid.py, norms get noise so a wrong convention cannot pass parity tests.
"""

import json
from pathlib import Path

import torch

from testing.tiny_hybrid import HEAD_SCALE, NORM_NOISE, TINY_QWEN3_5

VOCAB_SIZE = 512
TINY_VL_TOKEN_IDS = dict(vision_start_token_id=500, vision_end_token_id=501, image_token_id=502,
                         video_token_id=503)
VISION_TOKENS = dict(vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>",
                     image_token_id="<|image_pad|>", video_token_id="<|video_pad|>")
TINY_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, in_channels=3, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh")
TINY_PREPROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                         size=dict(shortest_edge=4 * 32 * 32, longest_edge=64 * 32 * 32),
                         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_rescale=True,
                         rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, resample=3,
                         image_processor_type="Qwen2VLImageProcessor")


def make_tiny_qwen3_5_vl(path: Path, text_dir_for_tokenizer: Path | None = None, seed: int = 0,
                         text_overrides: dict | None = None, chat_template: str | None = None) -> Path:
    """Writes config.json, model.safetensors (`model.visual.*`, `model.language_model.*`, `lm_head.*`),
    preprocessor_config.json and, with text_dir_for_tokenizer, the tokenizer files to path (with
    `chat_template` as its template, if given); returns path. `text_overrides` change the text model (a
    bigger one for bench/serve_path/multiturn.py --images; its rope_parameters must carry an mrope_section that
    fits)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    tokenizer, vocab_size, token_ids = _tokenizer(text_dir_for_tokenizer)
    text = {**TINY_QWEN3_5, "layer_types": ["linear_attention", "full_attention"] * 2, "head_dim": 32,
            "vocab_size": vocab_size, "bos_token_id": getattr(tokenizer, "bos_token_id", None),
            "eos_token_id": getattr(tokenizer, "eos_token_id", None)}
    # head_dim 32 * partial_rotary_factor 0.25 = 8 rotary dims, 4 frequencies: interleaved t, h, w, t
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text.update(text_overrides or {})
    vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
    config = Qwen3_5Config(text_config=text, vision_config=vision, **token_ids)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    _perturb(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2))
    if tokenizer is not None:
        tokenizer.chat_template = chat_template or tokenizer.chat_template
        tokenizer.save_pretrained(str(path))
    return path


def _tokenizer(text_dir: Path | None):
    """-> (tokenizer or None, vocab_size, the four vision token ids)."""
    if text_dir is None:
        return None, VOCAB_SIZE, dict(TINY_VL_TOKEN_IDS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(text_dir), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in VISION_TOKENS.items()}
    return tokenizer, len(tokenizer), ids


def _perturb(model) -> None:
    """Decisive greedy head; noise on norms and dt_bias (text), and on LayerNorms and biases (vision), which
    transformers' init sets to constants."""
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
        for name, param in model.named_parameters():
            is_text_norm = name.endswith("norm.weight") or name.endswith("dt_bias")
            is_vision_const = ".visual." in f".{name}" and (name.endswith("bias") or "norm" in name)
            if is_text_norm or is_vision_const:
                param.add_(NORM_NOISE * torch.randn_like(param))
