"""Gated DeltaNet's recurrent core as two native CPU ops (cpu_gated_delta.cpp, torch.ops.tether): the causal conv
with its state, and the gated delta rule with its gating and gated norm, over a whole varlen step. Its
PyTorch reference is GatedDeltaNet's own path (conv and delta rule from naive.py, then the gated norm).

Every sequence runs token by token, state in float32, so a sequence's state after a token has the same bits
however its tokens were split into steps (one prefill chunk, many, or decode rows) and whatever else the
step holds: checkpoints are exact and the layer batch invariant. Both ops also copy out the states after given
rows of the step (snapshots): a checkpoint inside a prefill chunk costs a copy, not a chunk boundary. One op call per layer and phase, no Python
per sequence or group, so the compiled step can trace it (the fakes below).

`native_gated_delta()` builds the library once per host (replicas/kernels/native_build.py) and returns its
op namespace, or None where it cannot be built (the layer then keeps its PyTorch path).
"""

import functools
from pathlib import Path

import torch

from replicas.kernels.native_build import load_native, mutates_only

SOURCES = [Path(__file__).with_name("cpu_gated_delta.cpp")]
FAKES = {"conv1d_silu_step": mutates_only, "gated_delta_step": mutates_only}


@functools.cache
def native_gated_delta():
    """torch.ops.tether (with these ops), or None."""
    return load_native("tether_gated_delta", SOURCES, FAKES)


NO_SNAPSHOTS = (torch.empty(0, dtype=torch.int64), torch.empty(0))


def conv1d_silu_step(x: torch.Tensor, weight_t: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                     has_initial: torch.Tensor, conv_state: torch.Tensor,
                     snapshots: tuple[torch.Tensor, torch.Tensor] = NO_SNAPSHOTS) -> torch.Tensor:
    """x: [T, C] -> silu(causal conv) [T, C] in x's dtype; conv_state [slots, C, W - 1] updated at `slots`.
    weight_t: [W, C] float32; cu_seqlens [S + 1] int64; slots [S] int64; has_initial [S] bool.
    snapshots: (rows [P] int64 ascending, out [P, C, W - 1]): the conv state after each of those rows."""
    y = torch.empty_like(x)
    torch.ops.tether.conv1d_silu_step(y, x, weight_t, cu_seqlens, slots, has_initial, conv_state, *snapshots)
    return y


def gated_delta_step(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, decay_rate: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, cu_seqlens: torch.Tensor,
                     slots: torch.Tensor, has_initial: torch.Tensor, recurrent_state: torch.Tensor,
                     num_k_heads: int, scale: float,
                     snapshots: tuple[torch.Tensor, torch.Tensor] = NO_SNAPSHOTS) -> torch.Tensor:
    """y: [T, 2HK + HV V] (the conv's output: q | k | v); a, b: [T, HV]; z: [T, HV, V] -> [T, HV, V] in y's
    dtype: the gated norm of the delta rule's output (norm_weight [V] float32), or the output itself (None).
    recurrent_state [slots, HV, K, V] float32 updated at `slots`. decay_rate = exp(A_log), dt_bias: [HV] float32.
    snapshots: (rows [P] int64 ascending, out [P, HV, K, V] float32): the state after each of those rows."""
    out = torch.empty(z.shape, dtype=y.dtype)
    norm = torch.empty(0) if norm_weight is None else norm_weight
    torch.ops.tether.gated_delta_step(out, y, a, b, z, decay_rate, dt_bias, norm, eps, cu_seqlens, slots,
                                      has_initial, recurrent_state, num_k_heads, scale, *snapshots)
    return out
