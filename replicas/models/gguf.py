"""GGUF -> Hugging Face checkpoint directory, for Llama-family models.

The engine loads one format: a Hugging Face style directory (config.json,
model.safetensors, tokenizer files). A GGUF file is converted once into that
format, float32 and dequantized, with llama.cpp's Q/K row permutation undone
so the weights follow HF's rotary convention (halves, not interleaved pairs).

We read the GGUF with the `gguf` package rather than transformers' loader:
the tensors come out one at a time (a progress bar per tensor), and nothing is
held packed. The tokenizer still goes through transformers, which already
knows how to build a fast BPE tokenizer from GGUF metadata.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF checkpoint name. "{i}" is the layer index.
TENSOR_NAMES = {
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


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a HF checkpoint for the Llama-family GGUF at `gguf_path` into `out_dir`.

    Writes config.json, generation_config.json, model.safetensors (float32,
    HF names) and the tokenizer files (tokenizer.json, tokenizer_config.json
    with the GGUF's chat template, special tokens). `out_dir` is created if
    needed; files already there are overwritten. Raises ValueError for an
    architecture other than llama or a tensor it does not know.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    config = read_config(reader)
    tensors = read_tensors(reader, config, progress)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes 0600; caches are shared
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    save_tokenizer(gguf_path, out_dir, field(reader, "tokenizer.chat_template"))


def field(reader: GGUFReader, key: str, default=None):
    """The decoded value of metadata `key`, or `default` when absent."""
    if key not in reader.fields:
        return default
    return reader.fields[key].contents()


def read_config(reader: GGUFReader) -> LlamaConfig:
    """A float32 LlamaConfig from the GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    hidden_size = field(reader, f"{arch}.embedding_length")
    num_heads = field(reader, f"{arch}.attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=int(embed.shape[1]),  # GGUF shapes are [cols, rows]
        hidden_size=hidden_size,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=field(reader, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=field(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        max_position_embeddings=field(reader, f"{arch}.context_length"),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensor_names,
        architectures=["LlamaForCausalLM"],
        dtype=torch.float32,
    )


def read_tensors(reader: GGUFReader, config: LlamaConfig, progress: bool) -> dict[str, torch.Tensor]:
    """Every GGUF tensor, dequantized to float32, under its HF name."""
    names = hf_names(config.num_hidden_layers)
    tensors = {}
    for t in tqdm(reader.tensors, desc="gguf -> safetensors", unit="tensor", disable=not progress):
        if t.name not in names:
            raise ValueError(f"unknown GGUF tensor {t.name!r}")
        # weights: [rows, cols] in HF's (out_features, in_features) order
        # copy: F32 tensors come back as read-only views of the memory-mapped file
        weights = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".attn_q." in t.name:
            weights = unpermute(weights, config.num_attention_heads)
        elif ".attn_k." in t.name:
            weights = unpermute(weights, config.num_key_value_heads)
        tensors[names[t.name]] = torch.from_numpy(np.ascontiguousarray(weights))
    return tensors


def hf_names(num_layers: int) -> dict[str, str]:
    """TENSOR_NAMES with the layer index filled in for every layer."""
    names = {}
    for gguf_name, hf_name in TENSOR_NAMES.items():
        for i in range(num_layers) if "{i}" in gguf_name else [None]:
            names[gguf_name.format(i=i)] = hf_name.format(i=i)
    return names


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


def save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """Build the fast tokenizer from the GGUF metadata and save it to `out_dir`."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    patch_tokenizer_config(out_dir / "tokenizer_config.json", chat_template)


# Loader arguments that transformers echoes into tokenizer_config.json.
LOADER_KEYS = ("is_local", "local_files_only", "gguf_file")


def patch_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Keep the chat template inline in tokenizer_config.json; drop echoed loader arguments."""
    config = json.loads(path.read_text())
    for key in LOADER_KEYS:
        config.pop(key, None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
