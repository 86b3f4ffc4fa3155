"""GGUF -> Hugging Face checkpoint directory, for the decoder families in gguf_families.py.

The engine loads one format: a Hugging Face style directory (config.json,
model.safetensors, tokenizer files). A GGUF file is converted once into that
format, float32 and dequantized, with what llama.cpp's converter changed
undone (gguf_families.py): the Q/K row permutation of architecture "llama"
(so the weights follow HF's rotary convention: halves, not interleaved pairs),
the +1 on Gemma's norm weights; stacked experts split into the hub's
per-expert tensors.

We read the GGUF with the `gguf` package rather than transformers' loader:
the tensors come out one at a time (a progress bar per tensor), and nothing is
held packed. The tokenizer still goes through transformers, which already
knows how to build a fast BPE tokenizer from GGUF metadata (gguf_tokenizer.py).
"""

import os
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import GenerationConfig

from model_files.gguf_config import read_config
from model_files.gguf_families import OPTIONAL_TENSORS, Family, family_of, hf_names
from model_files.gguf_tokenizer import save_tokenizer

# What llama.cpp's Q4_K_M / Q5_K_M / Q6_K / Q8_0 / F16 files hold. Q5_0 / Q5_1 are in there too:
# llama.cpp falls back to them from Q4_K / Q5_K for rows that are not whole 256-wide super-blocks
# (llama-quant.cpp, e.g. Qwen2.5-0.5B's hidden size 896).
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a HF checkpoint for the GGUF at `gguf_path` into `out_dir`.

    Writes config.json, generation_config.json, model.safetensors (float32,
    HF names) and the tokenizer files (tokenizer.json, tokenizer_config.json
    with the GGUF's chat template, special tokens). `out_dir` is created if
    needed; files already there are overwritten. Raises ValueError, before
    writing anything, for an architecture not in gguf_families.FAMILIES, a
    tensor it does not know or whose type is not in SUPPORTED_TYPES, and rope
    scaling HF cannot express exactly.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    arch = field(reader, "general.architecture")
    family = family_of(arch)
    tensors = {t.name: t for t in reader.tensors}
    check_tensors(family, tensors, field(reader, f"{arch}.block_count"))
    config = read_config(partial(field, reader), arch, tensors)
    weights = read_tensors(reader, family, config, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes 0600; caches are shared
    config.save_pretrained(out_dir)
    generation_config(reader, config).save_pretrained(out_dir)
    save_tokenizer(gguf_path, out_dir, field(reader, "tokenizer.chat_template"))


def field(reader: GGUFReader, key: str, default=None):
    """The decoded value of metadata `key`, or `default` when absent."""
    if key not in reader.fields:
        return default
    return reader.fields[key].contents()


def check_tensors(family: Family, tensors: dict, num_layers: int) -> None:
    """Every tensor known to the family and of a supported type, and none missing; so a bad file
    fails in milliseconds rather than after minutes of dequantizing."""
    names = set(hf_names(family, num_layers)) | set(family.config_tensors)
    for name, t in tensors.items():
        if name not in names:
            raise ValueError(f"unknown GGUF tensor {name!r} for a {family.hf_architecture}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {name} has type {t.tensor_type.name}; "
                             f"supported: {', '.join(q.name for q in SUPPORTED_TYPES)}")
    missing = set(hf_names(family, num_layers)) - set(tensors) - set(OPTIONAL_TENSORS)
    if missing:
        raise ValueError(f"GGUF lacks tensors {sorted(missing)[:5]}")


def read_tensors(reader: GGUFReader, family: Family, config, progress: bool) -> dict[str, torch.Tensor]:
    """Every GGUF weight, dequantized to float32, under its HF name; a stacked expert tensor as one
    tensor per expert, dequantized one expert at a time (a 30B MoE layer's stack is ~1 GB in float32)."""
    names = hf_names(family, config.num_hidden_layers)
    tensors = {}
    for t in tqdm(reader.tensors, desc="gguf -> safetensors", unit="tensor", disable=not progress):
        if t.name in family.config_tensors:
            continue  # in config.json's rope_parameters by now
        if "{e}" in names[t.name]:
            # t.data: [E, rows, packed row]
            for e in range(t.data.shape[0]):
                tensors[names[t.name].replace("{e}", str(e))] = read_weight(family, config, t.name, t.data[e],
                                                                            t.tensor_type)
        else:
            tensors[names[t.name]] = read_weight(family, config, t.name, t.data, t.tensor_type)
    return tensors


def read_weight(family: Family, config, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """One GGUF tensor (or one expert's slice) as HF holds it: float32, llama.cpp's changes undone."""
    # weights: [rows, cols] in HF's (out_features, in_features) order
    # copy: F32 tensors come back as read-only views of the memory-mapped file
    weights = np.array(dequantize(data, qtype), dtype=np.float32)
    if family.permutes_qk and ".attn_q." in name:
        weights = unpermute(weights, config.num_attention_heads)
    elif family.permutes_qk and ".attn_k." in name:
        weights = unpermute(weights, config.num_key_value_heads)
    if family.norm_shift and name.endswith("norm.weight"):
        weights -= family.norm_shift
    return torch.from_numpy(np.ascontiguousarray(weights))


def unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation of rows, per head.

    llama.cpp's converter regroups each head's rows [first half | second half]
    into interleaved pairs (h0, h_half, h1, h_half+1, ...) for its rotary
    kernel. Within each head of D rows:

        gguf row:  0    1      2    3        ...
        hf row:    0    D/2    1    D/2+1    ...
    """
    # weights: [num_heads * D, in_features]
    rows = weights.shape[0]
    head_half = rows // num_heads // 2
    w = weights.reshape(num_heads, head_half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def generation_config(reader: GGUFReader, config) -> GenerationConfig:
    """The config's bos / eos / pad, with every end-of-generation id llama.cpp stops on as eos:
    instruct GGUFs name the end of a turn (Llama 3's <|eot_id|>) apart from EOS."""
    generation = GenerationConfig.from_model_config(config)
    stops = [config.eos_token_id] + [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    stops = list(dict.fromkeys(i for i in stops if i is not None))
    if len(stops) > 1:
        generation.eos_token_id = stops
    return generation
