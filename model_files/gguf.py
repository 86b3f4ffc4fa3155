"""GGUF -> a model directory, for the decoder families in gguf_families.py.

The engine loads a Hugging Face style directory (config.json, tokenizer files,
weights). For a GGUF the weights stay the file's: the directory links it
(`model.gguf`), and the engine keeps each tensor in its block format
(replicas/models/gguf_loader.py). `iter_weights` yields them one at a time under
their HF names with what llama.cpp's converter changed in row order undone
(gguf_families.py): the Q/K row permutation of architecture "llama" (so the
weights follow HF's rotary convention: halves, not interleaved pairs), whole
rows of blocks moved as bytes; stacked experts split per expert. The
float32 form (`convert_gguf`: dequantized, the +1 on Gemma's norm weights
undone) is the reference checkpoint transformers loads.

We read the GGUF with the `gguf` package rather than transformers' loader:
the tensors come out one at a time, as the file's bytes. The tokenizer still goes through transformers, which already
knows how to build a fast BPE tokenizer from GGUF metadata (gguf_tokenizer.py).
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
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
GGUF_LINK = "model.gguf"  # in a model directory: the GGUF whose blocks the engine keeps


@dataclass
class GGUFModel:
    """An opened GGUF: its reader (the file memory-mapped), family, tensors by name and HF config."""
    path: Path
    reader: GGUFReader
    family: Family
    tensors: dict
    config: object


@dataclass
class WeightRows:
    """One weight under its HF name as the file holds it: `rows` [N, row bytes] uint8 of type `qtype`, `cols`
    weights a row (a permuted copy for llama's Q/K, else a view of the mapped file)."""
    name: str
    qtype: GGMLQuantizationType
    rows: np.ndarray
    shape: tuple[int, ...]  # HF's: [out, in] for a matrix, [n] for a vector
    source: np.ndarray | None = None  # the bytes in the mapped file (rows may be a permuted copy of them)

    @property
    def cols(self) -> int:
        return self.shape[-1]


class WeightsReader(GGUFReader):
    """GGUFReader that skips over long arrays (the vocabulary, its merges and token types) rather than parsing
    them: the package makes a numpy array or two per element, ~400 MB and 6 s for a 128k-token vocabulary, which
    the weights never need (the tokenizer is read by transformers, gguf_tokenizer.py). Those fields read back
    empty."""

    LONG = 4096  # elements; the metadata the config reads (per-layer patterns) is shorter

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self._get(orig_offs + 4, np.uint64)[0] <= self.LONG:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, offs = GGUFValueType(int(raw_itype[0])), orig_offs + 12
        if itype == GGUFValueType.STRING:  # each: a uint64 length, then the bytes
            view, order = memoryview(self.data), "big" if self.byte_order == "S" else "little"
            for _ in range(int(alen[0])):
                offs += 8 + int.from_bytes(view[offs:offs + 8], order)
        else:
            offs += int(alen[0]) * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
        return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]


def open_gguf(gguf_path: Path) -> GGUFModel:
    """Reads the metadata and tensor index; raises ValueError (before any weight is read) for an architecture
    not in gguf_families.FAMILIES, an unknown tensor or one of a type not in SUPPORTED_TYPES, and rope scaling
    HF cannot express exactly."""
    reader = WeightsReader(Path(gguf_path))
    arch = field(reader, "general.architecture")
    family = family_of(arch)
    tensors = {t.name: t for t in reader.tensors}
    check_tensors(family, tensors, field(reader, f"{arch}.block_count"))
    config = read_config(partial(field, reader), arch, tensors)
    return GGUFModel(Path(gguf_path), reader, family, tensors, config)


def write_model_dir(gguf_path: Path, out_dir: Path, float32: bool = False, progress: bool = True) -> None:
    """A model directory for the GGUF at `gguf_path` in `out_dir` (created if needed; files there overwritten):
    config.json, generation_config.json, the tokenizer files (tokenizer.json, tokenizer_config.json with the
    GGUF's chat template, special tokens), and the weights: `model.gguf`, a link to the file (the engine keeps its
    blocks: replicas/models/gguf_loader.py), or with `float32` model.safetensors, every weight dequantized to
    float32 under its HF name (a checkpoint transformers loads: the reference the tests compare with)."""
    gguf = open_gguf(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if float32:
        weights = {w.name: dense_weight(gguf.family, w) for w in tqdm(
            iter_weights(gguf), total=len(gguf.tensors), desc="gguf -> safetensors", unit="tensor",
            disable=not progress)}
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
        os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes 0600; caches are shared
    else:
        link = out_dir / GGUF_LINK
        link.unlink(missing_ok=True)
        link.symlink_to(Path(gguf_path).resolve())
    gguf.config.save_pretrained(out_dir)
    generation_config(gguf.reader, gguf.config).save_pretrained(out_dir)
    save_tokenizer(gguf_path, out_dir, field(gguf.reader, "tokenizer.chat_template"))


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """The float32 checkpoint of write_model_dir (the reference)."""
    write_model_dir(gguf_path, out_dir, float32=True, progress=progress)


def iter_weights(gguf: GGUFModel) -> Iterator[WeightRows]:
    """Every weight of the file under its HF name, one at a time, as its rows of blocks; a stacked expert tensor
    as one entry per expert. Config tensors (rope) are skipped: config.json holds them."""
    names = hf_names(gguf.family, gguf.config.num_hidden_layers)
    for t in gguf.reader.tensors:
        if t.name in gguf.family.config_tensors:
            continue
        data = np.asarray(t.data)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the row length first
        if "{e}" in names[t.name]:
            # t.data: [E, rows, packed row]
            for e in range(data.shape[0]):
                yield weight_rows(gguf, names[t.name].replace("{e}", str(e)), t.name, data[e], t.tensor_type,
                                  shape[1:])
        else:
            yield weight_rows(gguf, names[t.name], t.name, data, t.tensor_type, shape)


def weight_rows(gguf: GGUFModel, name: str, gguf_name: str, data: np.ndarray, qtype, shape) -> WeightRows:
    flat = data.view(np.uint8)
    rows = flat.reshape(-1, flat.shape[-1]) if flat.ndim > 1 else flat.reshape(1, -1)
    family, config = gguf.family, gguf.config
    if family.permutes_qk and ".attn_q." in gguf_name:
        rows = unpermute(rows, config.num_attention_heads)
    elif family.permutes_qk and ".attn_k." in gguf_name:
        rows = unpermute(rows, config.num_key_value_heads)
    return WeightRows(name, GGMLQuantizationType(qtype), rows, shape, flat)


def dense_weight(family: Family, weight: WeightRows) -> torch.Tensor:
    """One weight as HF holds it: float32 (the gguf package's dequantize), llama.cpp's norm shift undone."""
    # copy: F32 tensors come back as read-only views of the memory-mapped file
    values = np.array(dequantize(weight.rows, weight.qtype), dtype=np.float32).reshape(weight.shape)
    if family.norm_shift and weight.name.endswith("norm.weight"):
        values -= family.norm_shift
    return torch.from_numpy(values)


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
