"""The native int8 linear kernel (int8_gemv.cpp): 8-bit weight groups x float32 / bf16 activations in
float32 math, for decode-sized batches (1-16 rows per pass over the weights), with float32 output. Made
for the LM head, whose weights GGUF stores as Q8_0.

A GGUF Q8_0 tensor stores each run of 32 weights of a row as `d * q` with q int8 in -127..127 and d a
float16. Dequantized to float32 (what the converted checkpoint holds) every group keeps that form
exactly: q * d has at most 8 + 11 significant bits, so float32 holds the product without rounding.
`eight_bit_groups` recovers (q, scale) from the float32 weight and proves it by rebuilding: q * scale in
float32 must equal the weight bit for bit (up to the sign of zeros), which is what the kernel rebuilds in
registers. So the kernel applies the checkpoint's own weights and differs from a float32 matmul only in
the order of its float32 sums, while it reads 1.125 bytes per weight (int8 + a float32 scale per 32)
instead of 4: SmolLM2's head [49152, 576] is 28 MB + 3.5 MB instead of 113 MB per decode step.

Built once per host ISA with replicas/cpu_isa.py's flags (AVX-512, AVX2+FMA, or scalar) by
replicas/kernels/native_build.py; `native_int8()` is None where it cannot be built.
"""

import functools
from pathlib import Path

import torch
from torch import nn

SOURCE = Path(__file__).with_name("int8_gemv.cpp")
GROUP_SIZE = 32  # GGUF's Q8_0 block
MAX_ROWS = 16  # rows per pass of the kernel over the weights; Int8Linear hands larger batches to `dense`
# groups per step of eight_bit_groups' search for scales below max|w| / 127: a small first step, so that
# a weight that is not 8-bit is turned down in milliseconds, then doubling steps
_FIRST_CHUNK, _MAX_CHUNK = 64, 16384


@functools.cache
def native_int8():
    """torch.ops.tether (int8_linear), or None where no compiler / build is available."""
    from replicas.kernels.native_build import load_native, mutates_only

    return load_native("tether_int8_gemv", [SOURCE], {"int8_linear": mutates_only})


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 | bf16, q [N, K] int8 contiguous, scale [N, K/G] float32 contiguous ->
    x @ (q * scale).T as float32 [M, N] (into `out` when given: contiguous float32 [M, N])."""
    if out is None:
        out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    torch.ops.tether.int8_linear(x, q, scale, group_size, out)
    return out


def eight_bit_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    """-> (q [N, K] int8 in -127..127, scale [N, K/G] float32) with q * scale == weight exactly in float32,
    or None where `weight` [N, K] float32 is not made of such groups.

    A group w = q * d (|q| <= 127, d > 0) has max|w| = max|q| * d, so d = max|w| / c for c = max|q| in
    1..127 -- and where d * c is exact (always for a float16 d, as GGUF's), that float32 division gives d
    back exactly. GGUF's Q8_0 quantizer uses the full range (c = 127: q = round(w * 127 / max|w|)), so
    every group is first tried at c = 127; groups that fail try c = 126, 125, .. 1 in chunks (64 groups, then doubling), and
    the first group that no c rebuilds ends the search (a weight that is not 8-bit fails at its first chunk).
    Any c that rebuilds the group exactly is as good as GGUF's own: the kernel applies the same weights.
    Groups of zeros get scale 0."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % group_size:
        return None
    rows, cols = weight.shape
    groups = weight.detach().reshape(rows, cols // group_size, group_size)
    amax = groups.abs().amax(-1)  # [N, K/G]
    scale = amax / 127
    q, ok = _rebuild(groups, scale)
    failed = (~ok).nonzero(as_tuple=True)
    if failed[0].numel():
        rows_at, groups_at = failed
        start, chunk = 0, _FIRST_CHUNK
        while start < rows_at.numel():
            r, g = rows_at[start:start + chunk], groups_at[start:start + chunk]
            found = _search(groups[r, g], amax[r, g])
            if found is None:
                return None
            q[r, g], scale[r, g] = found
            start, chunk = start + chunk, min(2 * chunk, _MAX_CHUNK)
    return q.to(torch.int8).view(rows, cols), scale.contiguous()


def _rebuild(groups: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [..., G], scale [...] -> (q = round(w / scale) float32 [..., G], whether each group is
    exactly q * scale with |q| <= 127 [...]). NaN / inf weights never pass."""
    q = (groups / torch.where(scale > 0, scale, 1)[..., None]).round_()
    ok = ((q * scale[..., None] == groups) & (q.abs() <= 127)).all(-1)
    return q, ok


def _search(groups: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """groups [C, G] that failed at c = 127 -> (q [C, G], scale [C]) from the largest c in 126..1 that
    rebuilds each exactly, or None where some group has none."""
    q_found, scale_found = torch.zeros_like(groups), torch.zeros_like(amax)
    left = torch.arange(groups.shape[0])
    for c in range(126, 0, -1):
        scale = amax[left] / c
        q, ok = _rebuild(groups[left], scale)
        q_found[left[ok]], scale_found[left[ok]] = q[ok], scale[ok]
        left = left[~ok]
        if not left.numel():
            return q_found, scale_found
    return None


class Int8Linear(nn.Module):
    """A bias-free linear layer with two copies of its weight: 8-bit groups (q int8 [N, K], scale float32
    [N, K/G]) run by the native kernel for batches of up to MAX_ROWS rows (float32 output), and `dense`
    (the float32 PackedLinear or nn.Linear it replaces) for larger ones, other shapes, or where the
    kernel could not be built."""

    def __init__(self, dense: nn.Module, q: torch.Tensor, scale: torch.Tensor, max_rows: int = MAX_ROWS):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group_size = self.in_features // scale.shape[1]
        self.max_rows = max_rows if native_int8() is not None else 0  # 0: every batch takes `dense`
        self.register_buffer("q", q.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)

    @classmethod
    def from_weight(cls, dense: nn.Module, weight: torch.Tensor, max_rows: int = MAX_ROWS):
        """An Int8Linear over `weight` [N, K] float32 (the layer's weight before any packing or cast)
        beside `dense`, or None where the weight is not 8-bit groups or the kernel cannot be built."""
        if native_int8() is None:
            return None
        groups = eight_bit_groups(weight)
        return None if groups is None else cls(dense, *groups, max_rows=max_rows)

    @property
    def weight(self) -> torch.Tensor:
        """The dense layer's weight (its dtype is what callers cast their input to)."""
        return self.dense.weight

    def int8_buffers(self) -> list[torch.Tensor]:
        """What one native call reads: the 8-bit weights and their group scales."""
        return [self.q, self.scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] float32 | bf16 -> [T, out_features] float32 (dense's dtype above max_rows)
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return self.dense(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        torch.ops.tether.int8_linear(x, self.q, self.scale, self.group_size, out)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 groups of " \
               f"{self.group_size}, native up to {self.max_rows} rows"
