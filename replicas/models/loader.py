"""Loads a checkpoint directory (config.json + *.safetensors) into our model classes, name for name."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from replicas.models.layers import RotaryEmbedding
from replicas.models.llama import LlamaForCausalLM, rope_theta
from replicas.models.qwen3_5 import Qwen3_5ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # text-only checkpoints (model_type qwen3_5_text)
}


def load_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device):
    config = load_config(model_dir)
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    with torch.device("meta"):
        model = ARCHITECTURES[arch](config)
    model = model.to_empty(device=device)
    model.tie_weights()
    _load_weights(model, Path(model_dir))
    model = model.to(dtype)
    _init_buffers(model, config, device)  # after the cast: rotary tables stay float32
    return model.eval(), config


def _load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    loaded = set()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}")
    for path in files:
        for name, tensor in load_file(str(path)).items():
            if name not in params:
                if name == "lm_head.weight" or "rotary_emb" in name:
                    continue  # tied head, or a buffer we compute
                raise ValueError(f"unexpected weight {name!r} in {path.name}")
            params[name].data.copy_(tensor)
            loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")


def _init_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    # Buffers (rotary cos/sin) were made on the meta device; rebuild them for real.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            head_dim = module.cos.shape[-1] * 2
            fresh = RotaryEmbedding(head_dim, module.cos.shape[0], rope_theta(config)).to(device)
            module.cos, module.sin = fresh.cos, fresh.sin
