"""A model directory whose weights are a GGUF (`model.gguf`, model_files/gguf.py): its tensors kept in their block
formats, never expanded to float32.

Before the model's weights are allocated (it is built on the meta device), every linear layer whose weight the
file holds as a matrix becomes a `GGUFLinear` shell (a merged q/k/v or gate/up projection one shell with a part
per checkpoint projection, each part of its own type), the embedding a `GGUFEmbedding`, and the head a
`GGUFLinear` (the embedding's blocks, where the head is tied). Then only the rest is allocated (norms, an MoE's
router and experts), and the file is read one tensor at a time: a kept tensor is repacked into its layer's tiles
(gguf_blocks.py) and its pages of the mapped file are released, everything else is dequantized into its
parameter as a float32 checkpoint would be. A replica so holds about the file's bytes (tests/models; the
8B-shaped file in docs/benchmarks.md).
"""

import logging
import mmap
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from model_files.gguf import GGUF_LINK, WeightRows, dense_weight, iter_weights, open_gguf
from replicas.kernels.cpu_linear.gguf_blocks import BlockWeight, GGUFEmbedding, GGUFLinear, native_gguf
from replicas.models.layers import MergedLinear

logger = logging.getLogger("ray.serve")




def gguf_file(model_dir: Path) -> Path | None:
    path = Path(model_dir) / GGUF_LINK
    return path if path.exists() else None


def use_gguf_shells(model: nn.Module, gguf_path: Path):
    """Swaps, on the meta-device `model`, each layer whose weights the GGUF keeps for an empty GGUF layer;
    -> (the opened GGUF, HF weight name -> (its layer, part name or None for an embedding))."""
    gguf = open_gguf(gguf_path)
    matrices = {w_name for w_name, ndim in _tensor_dims(gguf).items() if ndim == 2}
    types_of = _tensor_types(gguf)
    targets = {}
    for path, module in list(model.named_modules()):
        if type(module) is nn.Embedding and f"{path}.weight" in matrices:
            shell = GGUFEmbedding(module.num_embeddings, module.embedding_dim)
            targets[f"{path}.weight"] = (shell, None)
        elif isinstance(module, MergedLinear) and all(f"{_parent(path)}.{s}.weight" in matrices for s in module.shards):
            shell = GGUFLinear(module.in_features, module.shards)
            types = {types_of[f"{_parent(path)}.{s}.weight"] for s in module.shards}
            if len(types) == 1:  # repacked straight into one tensor for all parts
                shell.stack_into(types.pop())
            for shard in module.shards:
                targets[f"{_parent(path)}.{shard}.weight"] = (shell, shard)
                targets[f"{_parent(path)}.{shard}.bias"] = (shell, shard)
        elif type(module) in (nn.Linear, MergedLinear) and f"{path}.weight" in matrices:  # one stored matrix
            shell = GGUFLinear(module.in_features, {"weight": module.out_features})
            targets[f"{path}.weight"], targets[f"{path}.bias"] = (shell, "weight"), (shell, "weight")
        else:
            continue
        _replace(model, path, shell)
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear and "lm_head.weight" not in matrices:  # tied to the embedding: its blocks
        embedding = model.get_submodule("model.embed_tokens") if "model.embed_tokens.weight" in targets else None
        if isinstance(embedding, GGUFEmbedding):
            shell = GGUFLinear(head.in_features, {"weight": head.out_features})
            _replace(model, "lm_head", shell)
            model.tied_head = shell
    return gguf, targets


def load_gguf_weights(model: nn.Module, gguf, targets: dict, device: torch.device, place_dense,
                      native: bool = True) -> Counter:
    """Reads every tensor of `gguf` once: kept ones into their shells (`targets`, use_gguf_shells'), the others
    through `place_dense(name, float32 tensor)`; -> tensors kept per type. Without `native` (or its op, or on
    another device than the CPU) the shells hold the weights dequantized to float32."""
    native = native and device.type == "cpu" and native_gguf() is not None
    if not native:
        logger.warning("GGUF blocks: the native op is off here; the kept layers hold float32 weights (4-8x the "
                       "file's bytes)")
    kept = Counter()
    for weight in iter_weights(gguf):
        target = targets.get(weight.name)
        if target is None:
            place_dense(weight.name, dense_weight(gguf.family, weight))
        elif weight.name.endswith(".bias"):
            target[0].set_bias(target[1], dense_weight(gguf.family, weight))
        else:
            kept[weight.qtype.name] += 1
            _keep(target, weight, device, native, lambda slab: _release(gguf, slab))
        _release(gguf, weight.source)
    missing = [name for name, (shell, part) in targets.items() if name.endswith(".weight") and
               (shell.table is None if part is None else part in shell.missing())]
    if missing:
        raise ValueError(f"weights missing from {gguf.path}: {sorted(missing)[:5]}")
    tied = getattr(model, "tied_head", None)
    if tied is not None:
        tied.set_part("weight", model.get_submodule("model.embed_tokens").table)
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.stack_parts()
    return kept


def load_dequantized(gguf_path: Path, place_dense) -> None:
    """Every weight of the GGUF dequantized to float32 into `model`'s parameters (engine.gguf_weights
    'dequantized'), a tensor at a time."""
    gguf = open_gguf(gguf_path)
    for weight in iter_weights(gguf):
        place_dense(weight.name, dense_weight(gguf.family, weight))
        _release(gguf, weight.source)


def _keep(target: tuple, weight: WeightRows, device: torch.device, native: bool, done) -> None:
    shell, part = target
    into = shell.part_buffer(part) if isinstance(shell, GGUFLinear) and native else None
    block = BlockWeight(weight.rows, weight.qtype, weight.cols, native=native, done=done, into=into)
    if device.type != "cpu":
        block.dense = block.dense.to(device)
    if part is None:
        shell.table = block
    else:
        shell.set_part(part, block)


def _release(gguf, view) -> None:
    """Drops the pages of the mapped file under `view` (an array in it) that reading brought in: they count in the
    replica's RSS until then. Arrays elsewhere (a permuted copy) are left alone."""
    backing = getattr(gguf.reader.data, "_mmap", None)
    if backing is None or not hasattr(backing, "madvise") or view is None or not view.size:
        return
    start, at = gguf.reader.data.ctypes.data, view.ctypes.data
    if not start <= at < start + len(backing):
        return
    offset = (at - start) // mmap.PAGESIZE * mmap.PAGESIZE
    length = at - start - offset + view.nbytes
    backing.madvise(mmap.MADV_DONTNEED, offset, min(length, len(backing) - offset))


def _tensor_types(gguf) -> dict:
    """HF weight name -> its GGMLQuantizationType (names of expert stacks left out)."""
    from model_files.gguf_families import hf_names

    names = hf_names(gguf.family, gguf.config.num_hidden_layers)
    return {names[name]: t.tensor_type for name, t in gguf.tensors.items()
            if name in names and "{e}" not in names[name]}


def _tensor_dims(gguf) -> dict[str, int]:
    """HF weight name -> its number of dimensions (an expert stack's per expert)."""
    from model_files.gguf_families import hf_names

    names = hf_names(gguf.family, gguf.config.num_hidden_layers)
    dims = {}
    for name, t in gguf.tensors.items():
        if name in names and "{e}" not in names[name]:
            dims[names[name]] = len(t.shape)
    return dims


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def kept_summary(model: nn.Module, kept: Counter, gguf_path: Path) -> str:
    held = sum(m.nbytes() for m in model.modules() if isinstance(m, GGUFLinear) and m is not
               getattr(model, "tied_head", None))
    held += sum(m.table.nbytes() for m in model.modules() if isinstance(m, GGUFEmbedding))
    types = ", ".join(f"{name} {count}" for name, count in sorted(kept.items()))
    return (f"GGUF blocks kept: {types} tensors; {held / 1e9:.2f} GB held for a {Path(gguf_path).stat().st_size / 1e9:.2f}"
            f" GB file")
