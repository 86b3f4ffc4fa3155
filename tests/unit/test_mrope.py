"""M-RoPE positions and column layout against transformers' Qwen3.5 (get_rope_index, recomposition)."""

import types

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from replicas.models.mrope import ImageSpan, image_positions, mrope_columns


def hf_positions(num_tokens: int, spans: list[ImageSpan]) -> tuple[np.ndarray, int]:
    """transformers' positions [3, T] and decode delta for a sequence with these images."""
    types_ = torch.zeros(1, num_tokens, dtype=torch.int32)
    for span in spans:
        types_[0, span.start:span.end] = 1
    model = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=2)))
    model.get_vision_position_ids = types.MethodType(hf.Qwen3_5Model.get_vision_position_ids, model)
    grids = torch.tensor([span.grid for span in spans]) if spans else None
    positions, delta = hf.Qwen3_5Model.get_rope_index(model, torch.zeros(1, num_tokens, dtype=torch.int64), types_,
                                                      image_grid_thw=grids)
    return positions[:, 0].numpy(), int(delta)


@pytest.mark.parametrize("layout", [
    [],  # text only: t = h = w = index
    [(3, (1, 4, 6))],  # one image mid-text: 2 x 3 merged tokens
    [(0, (1, 8, 4))],  # an image first
    [(2, (1, 4, 4)), (9, (1, 6, 10))],  # two images of different sizes
    [(1, (1, 2, 2)), (3, (1, 2, 2))],  # two one-token images, one token apart (templates put markers between)
])
def test_positions_match_transformers(layout):
    spans = [ImageSpan(start, grid, 2) for start, grid in layout]
    num_prompt = max((s.end for s in spans), default=0) + 5
    ours = image_positions(spans, 0, num_prompt)
    theirs, delta = hf_positions(num_prompt, spans)
    np.testing.assert_array_equal(ours, theirs)
    # decode: index + delta on every axis; and any slice equals the whole's columns (chunked prefill)
    decode = image_positions(spans, num_prompt, num_prompt + 3)
    np.testing.assert_array_equal(decode, np.arange(num_prompt, num_prompt + 3)[None].repeat(3, 0) + delta)
    for lo, hi in ((0, 4), (4, num_prompt), (3, 7)):
        hi = min(hi, num_prompt)
        np.testing.assert_array_equal(image_positions(spans, lo, hi), ours[:, lo:hi])


def test_columns_match_the_interleaved_recomposition():
    sections, rotary_dim = [11, 11, 10], 64
    freqs = torch.arange(3)[:, None, None, None].float().expand(3, 1, 1, rotary_dim // 2).clone()  # axis id
    layer = types.SimpleNamespace(mrope_section=sections)
    recomposed = hf.Qwen3_5TextRotaryEmbedding.recomposition_frequencies(layer, freqs)[0, 0]  # [rotary_dim]
    assert torch.equal(mrope_columns(rotary_dim, sections), recomposed.long())
