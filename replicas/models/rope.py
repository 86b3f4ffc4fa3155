"""Rotary position embedding: the tables every family rotates q and k with, and the step's view of them.

The inverse frequencies come from transformers' own RoPE functions (`ROPE_INIT_FUNCTIONS`: llama3, linear,
yarn, longrope), so every scaling rule is the reference's, bit for bit; the default rule is computed here. The
tables hold each position's cos and signed sin, already multiplied by the rule's attention scaling (longrope,
yarn), over the rotary width (head_dim * partial_rotary_factor, the first dims of each head):

    rotate(x) = x * cos + swap_halves(x) * sin = [x1 cos - x2 sin, x2 cos + x1 sin]   (rotate-half convention)

LongRoPE picks its short factors for a sequence of at most `original_max_position_embeddings` tokens and its
long ones beyond; transformers decides per forward from the longest position, which would rotate a cached key
differently once its sequence grew. Here the choice is per position: rows below the original length use the
short factors, rows from it on the long ones. A sequence that stays within the original length (the common
case) is rotated exactly as transformers does; a longer one keeps its earlier keys as they were cached (as
llama.cpp and vLLM do), and a prefix-cache hit stays exact, since a key's rotation depends on its position only.
"""

from dataclasses import dataclass

import torch
from torch import nn

from replicas.kernels import fused_cpu

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters (transformers 5: `rope_parameters`, per layer type for Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params


def check_rope(config, layer_type: str | None = None) -> None:
    rope_type = rope_parameters(config, layer_type).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                         " (a scaling that changes with the sequence length would rotate cached keys differently)")


def inverse_frequencies(config, layer_type: str | None = None,
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rotary_dim / 2] float32 on the CPU, attention scaling of cos and sin)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    cpu = torch.device("cpu")
    with cpu:  # the model is built on the meta device; the tables are computed for real
        if rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, seq_len=seq_len, layer_type=layer_type)
            return inv_freq.float(), float(scaling)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        theta = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def rope_tables(config, max_position: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [max_position, rotary_dim] float32 each (see the module note for LongRoPE's rows)."""
    positions = torch.arange(max_position, dtype=torch.float32)
    inv_freq, scaling = inverse_frequencies(config, layer_type)
    freqs = torch.outer(positions, inv_freq)  # [P, rotary_dim / 2]
    params = rope_parameters(config, layer_type)
    if params.get("rope_type") == "longrope":
        original = int(params["original_max_position_embeddings"])
        long_inv_freq, _ = inverse_frequencies(config, layer_type, seq_len=original + 1)
        freqs[original:] = torch.outer(positions[original:], long_inv_freq)
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """The rotary tables of one layer type; `materialize` computes them (the loader calls it: the model is built
    on the meta device)."""

    def __init__(self, config, max_position: int, layer_type: str | None = None):
        super().__init__()
        self.config, self.max_position, self.layer_type = config, max_position, layer_type
        inv_freq, _ = inverse_frequencies(config, layer_type)
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("cos", torch.empty(max_position, self.rotary_dim), persistent=False)  # [P, rotary_dim]
        self.register_buffer("sin", torch.empty(max_position, self.rotary_dim), persistent=False)  # [P, rotary_dim]
        self.native = False  # rotate with the fused CPU op (set by layers.use_native_ops where it is built)

    def materialize(self, device: torch.device) -> None:
        cos, sin = rope_tables(self.config, self.max_position, self.layer_type)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def step_mrope(self, positions: torch.Tensor, columns: torch.Tensor) -> "StepRope":
        """M-RoPE (replicas/models/mrope.py): positions [3, T] (t, h, w of each token), columns [R] the axis
        each rotary column reads. Rotated by the PyTorch path (gathered tables)."""
        num_tokens, width = positions.shape[1], self.cos.shape[-1]
        index = columns.to(positions.device).view(1, 1, width).expand(1, num_tokens, width)
        cos = self.cos[positions].gather(0, index)[0]  # [3, T, R] -> [T, R]
        sin = self.sin[positions].gather(0, index)[0]
        return StepRope(positions[0], self.cos, self.sin, (cos.unsqueeze(1), sin.unsqueeze(1)))

    def step_rope(self, positions: torch.Tensor) -> "StepRope":
        """What every layer of one step rotates with: the native op reads the whole tables at `positions`;
        the PyTorch path gathers them once per step."""
        gathered = None if self.native and positions.device.type == "cpu" else (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return StepRope(positions, self.cos, self.sin, gathered)


@dataclass(slots=True)
class StepRope:
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # [P, R] float32, R = the rotary width
    sin: torch.Tensor  # [P, R] float32, signed (RotaryEmbedding)
    gathered: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [T, 1, R]; None where the native op rotates

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D], D >= R: its first R dims rotated (partial rotary leaves the rest). In place (x
        returned) on the native path."""
        width = self.cos.shape[-1]
        if self.gathered is None:
            fused_cpu.rotary_embedding_(x if width == x.shape[-1] else x[..., :width], self.positions, self.cos,
                                        self.sin)
            return x
        if width == x.shape[-1]:
            return rotate(x, *self.gathered)
        return torch.cat((rotate(x[..., :width], *self.gathered), x[..., width:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, R] in float32, cast back. cos, sin: [T, 1, R] (StepRope.gathered)."""
    x_float = x.float()
    out = x_float * cos
    out += x_float.roll(x.shape[-1] // 2, dims=-1).mul_(sin)  # [x2, x1] * [-sin, sin]
    return out.to(x.dtype)
