"""M-RoPE: the multimodal rotary of Qwen2-VL, with Qwen3-VL's / Qwen3.5's interleaved frequency layout.

Each token has three positions (t, h, w). Text tokens carry the same value on all three, so a text-only
sequence is plain RoPE and our text path is exact without this module. An image's tokens (its merged grid,
row-major) starting at position s get t = s + frame, h = s + row, w = s + col; the position after the image
is s + max(grid_h, grid_w) / merge; text after it continues from there, and decode uses that offset too
(transformers' Qwen3_5Model.get_rope_index and get_vision_position_ids).

Frequency i of the rotary (i < rotary_dim / 2) takes its angle from one axis: h where i % 3 == 1 and
i < 3 * sections[1], w where i % 3 == 2 and i < 3 * sections[2], t otherwise (the interleaved layout
[THWTHW...TT]; apply_interleaved_mrope / recomposition_frequencies). Columns j and j + rotary_dim / 2 share
frequency j (rotate-half).
"""

from dataclasses import dataclass

import numpy as np
import torch


def mrope_columns(rotary_dim: int, sections: list[int]) -> torch.Tensor:
    """-> [rotary_dim] int64: the axis (0 t, 1 h, 2 w) each rotary column takes its position from."""
    half = rotary_dim // 2
    axis = torch.zeros(half, dtype=torch.int64)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset:sections[dim] * 3:3] = dim
    return torch.cat((axis, axis))


def mrope_sections(config) -> list[int] | None:
    """The text config's mrope_section, or None for a model without M-RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return list(params["mrope_section"]) if params.get("mrope_section") else None


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image's run of tokens in a sequence."""
    start: int  # index of its first token in the sequence's token ids
    grid: tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge
    merge: int  # spatial merge size

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def num_tokens(self) -> int:
        t, h, w = self.merged_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def position_advance(self) -> int:
        """How far the position moves over the image (text after it continues from start + this)."""
        _, h, w = self.merged_grid
        return max(h, w)


def image_positions(spans: list[ImageSpan], lo: int, hi: int) -> np.ndarray:
    """Positions [3, hi - lo] int64 of token indices lo..hi-1 of a sequence whose images are `spans` (in
    order, not overlapping); tokens past the prompt (decode) included: they continue the text rule."""
    index = np.arange(lo, hi, dtype=np.int64)
    out = np.empty((3, hi - lo), dtype=np.int64)
    shift = np.zeros(hi - lo, dtype=np.int64)  # position - index, for text tokens
    offset = 0  # position - index after the spans seen so far
    for span in spans:
        after = index >= span.end
        shift[after] = offset + span.position_advance - span.num_tokens
        offset += span.position_advance - span.num_tokens
    out[:] = index + shift
    for span in spans:
        a, b = max(span.start, lo), min(span.end, hi)
        if a >= b:
            continue
        start_pos = span.start + _offset_before(spans, span)
        t, h, w = span.merged_grid
        k = np.arange(a - span.start, b - span.start)  # offsets inside the image, row-major over (t, h, w)
        out[0, a - lo:b - lo] = start_pos + k // (h * w)
        out[1, a - lo:b - lo] = start_pos + (k // w) % h
        out[2, a - lo:b - lo] = start_pos + k % w
    return out


def _offset_before(spans: list[ImageSpan], span: ImageSpan) -> int:
    """position - index at `span`'s first token: what the images before it moved."""
    return sum(s.position_advance - s.num_tokens for s in spans if s.end <= span.start)
