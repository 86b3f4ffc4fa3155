"""GGUF weights kept in their file's block formats: the repacked layout, and the layers that run on it.

A GGUF tensor [N, K] of type Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / F16 / BF16 / F32 is
rows of blocks (QK weights each: 32, 256, or 1 for the float types). `repack` reorders those bytes once, at
load, into gguf_gemm.cpp's tiles (VL rows side by side, each block's fields in runs of VL): the same bytes,
so a layer holds what the file holds. Rows are repacked a few thousand at a time, so loading needs the
tensor's bytes plus a bounded slab, never a float32 copy.

`GGUFLinear` runs one linear layer (or a merged projection whose parts may differ in type: llama.cpp's
Q4_K_M keeps some layers' V and down projections in Q6_K) on those tiles with `tether::gguf_linear`: every
weight rebuilt exactly as the gguf package dequantizes it, every output summed in one fixed order over k
(batch invariant). Float32 activations get invariant_gemm.cpp's widen form over the dequantized weight, bit for
bit; bf16 ones, where the build has AVX512-BF16, its pairs form over that weight rounded to bf16 (what the
same weights converted to a bf16 checkpoint give), elsewhere the widen form on the float32 weight. `GGUFEmbedding`
looks up rows the same way (`tether::gguf_rows`). The references are naive.py's `naive_gguf_linear` (the
gguf package's dequantize, then F.linear). Where the native op cannot be built, the layers hold the
dequantized float32 weight instead (4-8x the file's bytes) and run F.linear: correct, not small.
"""

import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from torch import nn

SOURCE = Path(__file__).with_name("gguf_gemm.cpp")

# type -> (weights per block, bytes per block, its fields in tile order: (offset in the GGUF block, bytes, unit))
# A unit-2 field is a float16 (a tile keeps its VL halves whole); unit-1 fields are runs of bytes.
BLOCKS = {
    Q.F32: (1, 4, [(0, 4, 4)]),
    Q.F16: (1, 2, [(0, 2, 2)]),
    Q.BF16: (1, 2, [(0, 2, 2)]),
    Q.Q4_0: (32, 18, [(0, 2, 2), (2, 16, 1)]),
    Q.Q4_1: (32, 20, [(0, 2, 2), (2, 2, 2), (4, 16, 1)]),
    Q.Q5_0: (32, 22, [(0, 2, 2), (2, 4, 1), (6, 16, 1)]),
    Q.Q5_1: (32, 24, [(0, 2, 2), (2, 2, 2), (4, 4, 1), (8, 16, 1)]),
    Q.Q8_0: (32, 34, [(0, 2, 2), (2, 32, 1)]),
    Q.Q4_K: (256, 144, [(0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 1)]),
    Q.Q5_K: (256, 176, [(0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 1), (48, 128, 1)]),
    Q.Q6_K: (256, 210, [(208, 2, 2), (192, 16, 1), (0, 128, 1), (128, 64, 1)]),  # the file: ql qh scales d
}
_REPACK_ROWS = 4096  # rows per slab of `repack`
_FLOAT32_PROBE = torch.empty(0)


@functools.cache
def native_gguf():
    """torch.ops.tether (gguf_linear, gguf_rows, gguf_layout), or None where it cannot be built."""
    from replicas.kernels.native_build import load_native, mutates_only

    return load_native("tether_gguf_gemm", [SOURCE], {"gguf_linear": mutates_only, "gguf_rows": mutates_only})


def tile_rows() -> int:
    """Rows per tile of the build's layout (its vector width in floats)."""
    return torch.ops.tether.gguf_layout()[0]


def row_bytes(qtype: Q, cols: int) -> int:
    qk, nbytes, _ = BLOCKS[qtype]
    if cols % qk:
        raise ValueError(f"a {qtype.name} row of {cols} weights is not whole blocks of {qk}")
    return cols // qk * nbytes


def repack(rows: np.ndarray, qtype: Q, tile: int, done=None, into: torch.Tensor | None = None) -> torch.Tensor:
    """rows [N, row bytes] uint8 (a GGUF tensor's rows, as the file holds them) -> the tiled layout, flat uint8
    [ceil(N / tile) * tile * row bytes] (rows past N are zero bytes: zero weights), written `into` that tensor if
    given. `done(slab)`, if given, is called with each slab of `rows` once it is copied (to drop a mapped file's
    pages as the copy goes)."""
    _, nbytes, fields = BLOCKS[qtype]
    n, width = rows.shape
    blocks = width // nbytes
    tiles = -(-n // tile)
    if into is None:
        into = torch.empty(tiles * blocks * tile * nbytes, dtype=torch.uint8)
    out = into.numpy().reshape(tiles, blocks, tile * nbytes)
    step = max(1, _REPACK_ROWS // tile)
    for t0 in range(0, tiles, step):
        slab = rows[t0 * tile:(t0 + step) * tile]
        count = -(-slab.shape[0] // tile)
        if slab.shape[0] < count * tile:
            slab = np.concatenate([slab, np.zeros((count * tile - slab.shape[0], width), np.uint8)])
        slab = slab.reshape(count, tile, blocks, nbytes)
        parts = [slab[..., at:at + size].reshape(count, tile, blocks, size // unit, unit)
                 .transpose(0, 2, 3, 1, 4).reshape(count, blocks, -1) for at, size, unit in fields]
        out[t0:t0 + count] = np.concatenate(parts, axis=-1)
        if done is not None:
            done(rows[t0 * tile:(t0 + step) * tile])
    return into


def dequantized(rows: np.ndarray, qtype: Q, cols: int) -> torch.Tensor:
    """rows [N, row bytes] -> [N, cols] float32, by the gguf package (the reference every kernel here equals)."""
    return torch.from_numpy(np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(-1, cols))


class BlockWeight:
    """One GGUF tensor [rows, cols] as a layer holds it: `packed` (repacked tiles) where the native op runs,
    else `dense` (float32)."""

    def __init__(self, rows: np.ndarray, qtype: Q, cols: int, native: bool = True, done=None,
                 into: torch.Tensor | None = None):
        self.qtype, self.rows, self.cols = Q(qtype), rows.shape[0], cols
        if native and native_gguf() is not None:
            self.packed, self.dense = repack(rows, self.qtype, tile_rows(), done, into), None
        else:
            self.packed, self.dense = None, dequantized(rows, self.qtype, cols)

    def nbytes(self) -> int:
        return (self.packed if self.packed is not None else self.dense).nbytes

    @classmethod
    def stacked(cls, parts: list["BlockWeight"], packed: torch.Tensor | None = None) -> "BlockWeight | None":
        """The parts' rows one after another as one weight, where they share a type and (tiled) whole tiles;
        else None. `packed`: the tensor the parts were repacked into, slice after slice (GGUFLinear.stack_into), if
        they were; else their tiles are copied into one."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.cols != first.cols for p in parts) or \
                (first.packed is not None and any(p.rows % tile_rows() for p in parts)):
            return None
        stacked = cls.__new__(cls)
        stacked.qtype, stacked.cols, stacked.rows = first.qtype, first.cols, sum(p.rows for p in parts)
        if first.packed is None:
            stacked.packed = None
        else:
            stacked.packed = packed if packed is not None else torch.cat([p.packed for p in parts])
        stacked.dense = None if first.dense is None else torch.cat([p.dense for p in parts])
        return stacked

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [M, cols] float32 | bf16 (rows contiguous) -> [M, rows] in x's dtype; bias: [rows] float32 or None
        if self.packed is None:
            return F.linear(x.float(), self.dense, bias).to(x.dtype)
        out = torch.empty(x.shape[0], self.rows, dtype=x.dtype)
        torch.ops.tether.gguf_linear(x, self.packed, int(self.qtype), self.rows, bias, out)
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] int64 -> [T, cols] float32
        if self.packed is None:
            return self.dense[ids]
        out = torch.empty(ids.shape[0], self.cols, dtype=torch.float32)
        torch.ops.tether.gguf_rows(self.packed, int(self.qtype), self.rows, ids.contiguous(), out)
        return out


class GGUFLinear(nn.Module):
    """A linear layer (or merged projection) on GGUF weights: `parts` in output order, each [rows_i, in_features]
    of its own type; the output is their concatenation (+ bias), in x's dtype.
    Made empty before the model's other weights are allocated (gguf_loader.py); `set_part` fills it."""

    def __init__(self, in_features: int, part_rows: dict[str, int]):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(part_rows.values())
        self.part_rows = dict(part_rows)
        self.parts: dict[str, BlockWeight] = {}
        self.bias: torch.Tensor | None = None  # [out_features] float32, added before the output's rounding
        self._stack: torch.Tensor | None = None  # stack_into's tensor for all parts, until stack_parts

    @property
    def weight(self) -> torch.Tensor:  # the model's forward reads only the head's dtype: float32 in, float32 out
        return _FLOAT32_PROBE

    def set_part(self, name: str, weight: BlockWeight) -> None:
        if weight.rows != self.part_rows[name] or weight.cols != self.in_features:
            raise ValueError(f"{name}: [{weight.rows}, {weight.cols}], expected [{self.part_rows[name]}, "
                             f"{self.in_features}]")
        self.parts[name] = weight

    def set_bias(self, name: str, bias: torch.Tensor) -> None:
        if self.bias is None:
            self.bias = torch.zeros(self.out_features)
        offset = 0
        for part, rows in self.part_rows.items():
            if part == name:
                self.bias[offset:offset + rows] = bias
            offset += rows

    def missing(self) -> list[str]:
        return [name for name in self.part_rows if name not in self.parts]

    def stack_into(self, qtype: Q) -> None:
        """Parts of `qtype` to come, in whole tiles: `part_buffer` hands each its slice of one tensor for all
        of them (no copy at stack_parts), where the native op runs."""
        if native_gguf() is None or any(rows % tile_rows() for rows in self.part_rows.values()):
            return
        row_bytes_ = row_bytes(qtype, self.in_features)
        self._stack = torch.empty(self.out_features * row_bytes_, dtype=torch.uint8)
        self._stack_offsets, offset = {}, 0
        for name, rows in self.part_rows.items():
            self._stack_offsets[name] = (offset, rows * row_bytes_)
            offset += rows * row_bytes_

    def part_buffer(self, name: str) -> torch.Tensor | None:
        if self._stack is None:
            return None
        offset, size = self._stack_offsets[name]
        return self._stack[offset:offset + size]

    def stack_parts(self) -> None:
        """One weight for all parts where they share a type (one kernel call, no concatenation)."""
        if len(self.parts) < 2 or self.missing():
            return
        stacked = BlockWeight.stacked([self.parts[name] for name in self.part_rows], self._stack)
        if stacked is not None:
            self.parts = {"+".join(self.part_rows): stacked}
            self.part_rows = {"+".join(self.part_rows): self.out_features}
        self._stack = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] float32 | bf16 -> [..., out_features] in x's dtype
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        outs, offset = [], 0
        for name, count in self.part_rows.items():  # parts arrive in the file's order: output order here
            bias = None if self.bias is None else self.bias[offset:offset + count]
            outs.append(self.parts[name].linear(rows, bias))
            offset += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts.values())

    def extra_repr(self) -> str:
        types = ", ".join(f"{name} {self.parts[name].qtype.name}" for name in self.part_rows if name in self.parts)
        form = "tiles" if all(p.packed is not None for p in self.parts.values()) else "dequantized"
        return f"in_features={self.in_features}, out_features={self.out_features}, {types} ({form})"


class GGUFEmbedding(nn.Module):
    """nn.Embedding's lookup on a GGUF tensor [vocab, hidden]; rows come out float32."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.table: BlockWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [...] int -> [..., embedding_dim] float32
        return self.table.lookup(ids.reshape(-1).long()).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = self.table.qtype.name if self.table is not None else "empty"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"
