"""Lossless packing of KV blocks and recurrent states for the host tier: byte planes, the top one compressed.

    x        [..., n elements] bf16 / fp16 / fp32 (any dtype; little-endian bytes)
    planes   [itemsize, n] uint8: plane b holds byte b of every element
    packed   top = deflate(plane itemsize - 1)  (sign + high exponent bits: ~2.9 bits of entropy per byte)
             rest = planes 0 .. itemsize - 2, raw   (mantissa bytes: ~8 bits per byte, they do not compress)

Measured on SmolLM2-135M KV (bench/engine/host_tier.py, docs/benchmarks.md): 1.45x for bfloat16, 1.19x for float32.
Deflate runs Huffman-only (no LZ77 matching): the top plane has few repeats to find, only a skewed byte
distribution, and Huffman-only packs it better than level 1 does (1.46x vs 1.38x overall) and 30% faster. `unpack(pack(x))` is
bit-exact (tests/unit/test_host_tier.py): the tier never rounds, so a restored block is the block.
"""

import math
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

assert sys.byteorder == "little", "byte planes assume little-endian element bytes"

# Elements of each width as integers: torch views through its signed types, numpy shifts unsigned ones.
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(slots=True)
class Packed:
    shape: tuple[int, ...]
    dtype: torch.dtype
    top: bytes  # the most significant byte plane, deflated
    rest: bytes  # the other planes, raw, plane 0 first: [itemsize - 1, n]

    @property
    def num_bytes(self) -> int:
        return len(self.top) + len(self.rest)


def _deflate(data: bytes) -> bytes:
    # Huffman-only: the plane's redundancy is its byte histogram, not repeated strings. Releases the GIL.
    compressor = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_HUFFMAN_ONLY)
    return compressor.compress(data) + compressor.flush()


def _words(x: torch.Tensor) -> np.ndarray:
    """x -> its elements as unsigned integers of the same width, flat (a view)."""
    return x.detach().contiguous().view(-1).view(_SIGNED[x.element_size()]).numpy().view(_UNSIGNED[x.element_size()])


def pack(x: torch.Tensor) -> Packed:
    """x: any CPU tensor -> Packed (a copy: x may change right after)."""
    size = x.element_size()
    words = _words(x)  # [n]
    top = _deflate((words >> (8 * (size - 1))).astype(np.uint8).tobytes())
    rest = b"".join(((words >> (8 * b)) & 0xFF).astype(np.uint8).tobytes() for b in range(size - 1))
    return Packed(tuple(x.shape), x.dtype, top, rest)


def unpack(packed: Packed) -> torch.Tensor:
    """-> the tensor `pack` was given, bit for bit (CPU, contiguous)."""
    size, n = packed.dtype.itemsize, math.prod(packed.shape)
    if n == 0:
        return torch.empty(packed.shape, dtype=packed.dtype)
    word = _UNSIGNED[size]
    words = np.frombuffer(zlib.decompress(packed.top), dtype=np.uint8).astype(word) << word(8 * (size - 1))
    rest = np.frombuffer(packed.rest, dtype=np.uint8).reshape(size - 1, n)  # [itemsize - 1, n]
    for b in range(size - 1):
        words |= rest[b].astype(word) << word(8 * b)
    return torch.from_numpy(words.view(_SIGNED_NP[size])).view(packed.dtype).view(packed.shape)
