"""RoPE tables (replicas/models/rope.py) against transformers' rotary embeddings, rule by rule; LongRoPE's
per-position choice of short and long factors; the refusal of a scaling that changes with the sequence."""

import pytest
import torch
import transformers

from replicas.models.rope import check_rope, rope_tables

SMALL = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=512)


def reference_tables(rotary, positions: torch.Tensor, layer_type=None):
    """transformers' cos, sin at `positions` ([P, R] each; sin as it comes, unsigned)."""
    x = torch.zeros(1, 1, dtype=torch.float32)
    args = (x, positions[None]) if layer_type is None else (x, positions[None], layer_type)
    cos, sin = rotary(*args)
    return cos[0], sin[0]


def assert_tables_match(config, rotary, layer_type=None, positions=None):
    positions = torch.arange(config.max_position_embeddings) if positions is None else positions
    cos, sin = rope_tables(config, config.max_position_embeddings, layer_type)
    ref_cos, ref_sin = reference_tables(rotary, positions, layer_type)
    half = cos.shape[-1] // 2
    assert torch.allclose(cos[positions], ref_cos, atol=1e-6)
    assert torch.allclose(sin[positions, half:], ref_sin[:, half:], atol=1e-6)  # ours: [-sin, sin]
    assert torch.allclose(-sin[positions, :half], ref_sin[:, :half], atol=1e-6)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
])
def test_static_rules_match_transformers(rope):
    config = transformers.LlamaConfig(**SMALL, rope_parameters=rope)
    assert_tables_match(config, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config))


def test_longrope_is_short_below_the_original_length_and_long_from_it():
    config = transformers.Phi3Config(**SMALL, original_max_position_embeddings=128, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75, original_max_position_embeddings=128,
        short_factor=[1.0 + 0.1 * i for i in range(6)], long_factor=[1.0 + 0.9 * i for i in range(6)]))
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    cos, _ = rope_tables(config, 512)
    assert cos.shape == (512, 12)  # partial rotary: 0.75 of head_dim 16
    # transformers picks the long factors for every position once the sequence passes 128 tokens: the positions
    # below 128 of a short sequence, and the positions from 128 of a long one, are ours.
    assert_tables_match(config, rotary, positions=torch.arange(128))
    long_positions = torch.arange(128, 512)
    full_cos, full_sin = reference_tables(rotary, torch.arange(512))
    assert torch.allclose(cos[long_positions], full_cos[long_positions], atol=1e-6)
    assert not torch.allclose(cos[:128], full_cos[:128], atol=1e-3)  # the long factors differ below 128


def test_gemma3_rules_are_per_layer_type():
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                           num_hidden_layers=2, rope_parameters={
                                               "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                               "full_attention": dict(rope_type="linear", factor=8.0,
                                                                      rope_theta=1000000.0)})
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        assert_tables_match(config, rotary, layer_type)


def test_a_scaling_that_changes_with_the_sequence_is_refused():
    config = transformers.LlamaConfig(**SMALL, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                    factor=2.0))
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        check_rope(config)
