"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) over a flattened varlen step, with its state outside.

A linear-attention layer's memory of a sequence is two tensors, held in state slots the engine owns
(as the KV cache holds attention's memory in blocks):

    conv_state       [num_slots, conv_dim, W - 1]   last W - 1 inputs of the causal conv (model dtype)
    recurrent_state  [num_slots, HV, K, V]          the delta-rule state (float32)

A step's sequences each name their slot (`state_slots`) and whether it holds their state so far
(`has_initial_state`; False: start from zeros, whatever the slot holds). Like attention's groups, the
sequences split into decode rows (one token: conv update + recurrent form) and prefill chunks (conv and
chunked gated delta rule over cu_seqlens), both in one forward; each group reads its slots, then writes
the new states back in place. A slot's state is exact at the step's last token, so copying both tensors of
every linear layer at slot s is a checkpoint of the sequence at that boundary.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update
from replicas.kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from replicas.kernels.gated_delta_rule import cpu_native


@dataclass(slots=True)
class LinearLayerState:
    """One linear-attention layer's state slots; allocated once by the engine, like a layer's KV cache."""
    conv_state: torch.Tensor  # [num_slots, conv_dim, W - 1], model dtype
    recurrent_state: torch.Tensor  # [num_slots, HV, K, V], float32


@dataclass(slots=True)
class LinearGroup:
    """Sequences of the step that run the same form (decode rows, or prefill chunks)."""
    rows: torch.Tensor | None  # [Tg] int64, their rows in the step's T, in order; None: all T rows
    cu_seqlens: torch.Tensor  # [Sg + 1] int64, over rows
    state_slots: torch.Tensor  # [Sg] int64
    has_initial_state: torch.Tensor  # [Sg] bool


@dataclass(slots=True)
class LinearStateBatch:
    """The step's view of the linear state: every linear layer's slots and the step's two groups, and where
    the native ops copy out states inside the step (snapshots: checkpoints that do not end a chunk)."""
    layers: list[LinearLayerState]  # one per linear-attention layer, in layer order
    state_slots: torch.Tensor  # [S] int64, the slot of each sequence of the step
    has_initial_state: torch.Tensor  # [S] bool
    decode: LinearGroup | None  # sequences with one query row this step
    prefill: LinearGroup | None  # sequences with more
    snapshot_rows: torch.Tensor  # [P] int64, ascending rows of the step: the states after them are copied out
    snapshots: list[LinearLayerState]  # per linear layer: [P, conv_dim, W - 1] and [P, HV, K, V] (P may be 0)


def make_linear_state_batch(layers: list[LinearLayerState], cu_seqlens: torch.Tensor | list[int],
                            state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                            snapshot_rows: list[int] = ()) -> LinearStateBatch:
    """Splits the step (cu_seqlens [S + 1], as ForwardBatch has it) into decode rows and prefill chunks; built
    once per step by the runner and read by every linear layer. Reads cu_seqlens on the host once.
    snapshot_rows (ascending; native recurrent ops only): rows after which every layer's states are copied out."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    device = state_slots.device
    members = ([s for s, n in enumerate(lengths) if n == 1], [s for s, n in enumerate(lengths) if n > 1])
    groups = []
    for seqs in members:
        if not seqs:
            groups.append(None)
            continue
        rows = [r for s in seqs for r in range(bounds[s], bounds[s + 1])]
        group_cu = [0]
        for s in seqs:
            group_cu.append(group_cu[-1] + lengths[s])
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        everything = len(seqs) == len(lengths)  # no gather / scatter needed
        groups.append(LinearGroup(None if everything else torch.tensor(rows, dtype=torch.int64, device=device),
                                  torch.tensor(group_cu, dtype=torch.int64, device=device),
                                  state_slots[index], has_initial_state[index]))
    rows = torch.tensor(list(snapshot_rows), dtype=torch.int64, device=device)
    snapshots = [LinearLayerState(*(torch.empty(len(rows), *t.shape[1:], dtype=t.dtype, device=device) if len(rows)
                                    else _no_snapshot(t) for t in (layer.conv_state, layer.recurrent_state)))
                 for layer in layers]
    return LinearStateBatch(layers, state_slots, has_initial_state, groups[0], groups[1], rows, snapshots)


_NO_SNAPSHOTS: dict[tuple, torch.Tensor] = {}


def _no_snapshot(states: torch.Tensor) -> torch.Tensor:
    """[0, *states.shape[1:]]: the snapshot buffer of a step that takes none, one per state tensor (never written;
    distinct tensors, as a step that takes snapshots has: the compiled step would guard on their aliasing)."""
    key = (id(states), tuple(states.shape), states.dtype, states.device)
    if key not in _NO_SNAPSHOTS:
        _NO_SNAPSHOTS[key] = states.new_empty(0, *states.shape[1:])
    return _NO_SNAPSHOTS[key]


def linear_state_shapes(config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per slot and linear layer: (conv_state [conv_dim, W - 1], recurrent_state [HV, K, V])."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
        + config.linear_num_value_heads * config.linear_value_head_dim
    return ((conv_dim, config.linear_conv_kernel_dim - 1),
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


def allocate_linear_states(config, num_slots: int, dtype: torch.dtype,
                           device: torch.device) -> list[LinearLayerState]:
    conv_shape, recurrent_shape = linear_state_shapes(config)
    num_layers = sum(t == "linear_attention" for t in config.layer_types)
    return [LinearLayerState(torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device),
                             torch.zeros(num_slots, *recurrent_shape, dtype=torch.float32, device=device))
            for _ in range(num_layers)]


@dataclass(slots=True)
class NativeParams:
    """A GatedDeltaNet's parameters as its native ops take them, made once after loading."""
    conv_weight_t: torch.Tensor  # [W, conv_dim] float32
    decay_rate: torch.Tensor  # [HV] float32: exp(A_log)
    dt_bias: torch.Tensor  # [HV] float32
    norm_weights: dict  # step dtype -> the gated norm's weight [V] as that dtype rounds it, in float32


def use_native_recurrent(model: nn.Module) -> int:
    """Puts every GatedDeltaNet of the model on the native ops where they build (CPU); returns how many layers.
    Call after the weights are loaded."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not layers or cpu_native.native_gated_delta() is None:
        return 0
    for layer in layers:
        norm = layer.norm.weight.detach()
        layer.native = NativeParams(
            layer.conv1d.weight.detach().squeeze(1).float().t().contiguous(), layer.A_log.detach().float().exp(),
            layer.dt_bias.detach().float(),
            {dtype: norm.to(dtype).float() for dtype in (torch.float32, torch.bfloat16)})
    return len(layers)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the core output per value head, then times silu(z) (transformers' Qwen3_5RMSNormGated:
    a plain weight, not 1 + weight)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """in_proj_qkv -> causal conv + silu -> q, k (l2-normalised in the kernel), v; in_proj_a/b -> decay g and
    beta; gated delta rule; gated RMSNorm with in_proj_z; out_proj. Names are the checkpoint's."""

    def __init__(self, config):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        width = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, width, bias=False, groups=self.conv_dim,
                                padding=width - 1)  # holds the weight [C, 1, W]; the kernels run it
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.native: NativeParams | None = None  # set by use_native_recurrent: the native ops' float32 copies

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, state: LinearLayerState | None = None,
                step: LinearStateBatch | None = None, snapshot: LinearLayerState | None = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. Without a step every sequence starts from zeros and no state is kept.
        snapshot: this layer's buffers for the step's snapshot rows (the native ops only take any)."""
        num_tokens = x.shape[0]
        mixed_qkv = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(num_tokens, self.num_v_heads, self.head_v_dim)
        if self.native is not None:
            o = self._native_core(mixed_qkv, z, self.in_proj_a(x), self.in_proj_b(x), cu_seqlens, state, step,
                                  snapshot)
            return self.out_proj(o.view(num_tokens, self.value_dim))
        if step is not None and step.snapshot_rows.numel():
            raise ValueError("snapshots inside a step need the native recurrent ops")
        beta = self.in_proj_b(x).sigmoid()  # [T, HV]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, HV] float32
        if step is None:
            no_state = torch.zeros(0, dtype=torch.int64, device=x.device)
            groups = [(LinearGroup(None, cu_seqlens, no_state, no_state.bool()), False)]
        else:
            groups = [(grp, is_decode) for grp, is_decode in ((step.decode, True), (step.prefill, False))
                      if grp is not None]
        o = mixed_qkv.new_empty(num_tokens, self.num_v_heads, self.head_v_dim)
        for group, is_decode in groups:
            rows = group.rows
            inputs = [t if rows is None else t[rows] for t in (mixed_qkv, g, beta)]
            o_g = self._run_group(*inputs, group, state, is_decode)
            if rows is None:
                o = o_g
            else:
                o[rows] = o_g
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.view(num_tokens, self.value_dim))

    def _native_core(self, mixed_qkv, z, a, b, cu_seqlens, state: LinearLayerState | None,
                     step: LinearStateBatch | None, snapshot: LinearLayerState | None = None) -> torch.Tensor:
        """The conv, the delta rule and the gated norm of every sequence of the step, two native calls:
        mixed_qkv [T, conv_dim], z [T, HV, V], a, b [T, HV] -> [T, HV, V]. Without a step: scratch slots."""
        dtype = mixed_qkv.dtype
        if step is None:
            num_seqs, device = cu_seqlens.numel() - 1, mixed_qkv.device
            state = LinearLayerState(
                torch.zeros(num_seqs, self.conv_dim, self.conv1d.weight.shape[-1] - 1, dtype=dtype, device=device),
                torch.zeros(num_seqs, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=device))
            slots = torch.arange(num_seqs, device=mixed_qkv.device)
            has_initial = torch.zeros(num_seqs, dtype=torch.bool, device=mixed_qkv.device)
        else:
            slots, has_initial = step.state_slots, step.has_initial_state
        params = self.native
        rows = cpu_native.NO_SNAPSHOTS[0] if snapshot is None else step.snapshot_rows
        conv_out, recurrent_out = (cpu_native.NO_SNAPSHOTS[1],) * 2 if snapshot is None else \
            (snapshot.conv_state, snapshot.recurrent_state)
        y = cpu_native.conv1d_silu_step(mixed_qkv, params.conv_weight_t, cu_seqlens, slots, has_initial,
                                        state.conv_state, (rows, conv_out))
        return cpu_native.gated_delta_step(y, a.to(dtype), b.to(dtype), z.to(dtype), params.decay_rate,
                                           params.dt_bias, params.norm_weights[dtype], self.norm.eps, cu_seqlens,
                                           slots, has_initial, state.recurrent_state, self.num_k_heads,
                                           self.head_k_dim ** -0.5, (rows, recurrent_out))

    def _run_group(self, mixed_qkv, g, beta, group: LinearGroup, state: LinearLayerState | None,
                   is_decode: bool) -> torch.Tensor:
        """mixed_qkv: [Tg, conv_dim]; g, beta: [Tg, HV] -> o [Tg, HV, V]. Reads the group's slots, then
        overwrites them with the states after its last token (slots are distinct within a step)."""
        weight = self.conv1d.weight.squeeze(1)  # [C, W]
        keep = state is not None
        conv0 = rec0 = None
        if keep:
            slots, has = group.state_slots, group.has_initial_state
            conv0 = torch.where(has[:, None, None], state.conv_state[slots], 0)
            rec0 = torch.where(has[:, None, None, None], state.recurrent_state[slots], 0)
        if is_decode:  # one token per sequence: B = Sg, T = 1 (only with a state: without one all is prefill)
            mixed_qkv, conv1 = causal_conv1d_update(mixed_qkv, conv0, weight, self.conv1d.bias, activation="silu")
            q, k, v = self._split(mixed_qkv, batch_first=True)
            o, rec1 = fused_recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], initial_state=rec0,
                                                       output_final_state=keep, use_qk_l2norm_in_kernel=True)
            o = o[:, 0]
        else:  # packed chunks: B = 1, T = Tg
            mixed_qkv, conv1 = causal_conv1d(mixed_qkv, weight, self.conv1d.bias, group.cu_seqlens, conv0,
                                             output_final_state=keep, activation="silu")
            q, k, v = self._split(mixed_qkv, batch_first=False)
            o, rec1 = chunk_gated_delta_rule(q, k, v, g[None], beta[None], initial_state=rec0,
                                             output_final_state=keep, cu_seqlens=group.cu_seqlens,
                                             use_qk_l2norm_in_kernel=True)
            o = o[0]
        if keep:
            state.conv_state.index_copy_(0, slots, conv1.to(state.conv_state.dtype))
            state.recurrent_state.index_copy_(0, slots, rec1.to(state.recurrent_state.dtype))
        return o

    def _split(self, mixed_qkv: torch.Tensor, batch_first: bool):
        # [Tg, conv_dim] -> q, k [B, T, H, K], v [B, T, HV, V]: decode B = Tg, T = 1; prefill B = 1, T = Tg
        shape = (-1, 1) if batch_first else (1, -1)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(*shape, self.num_k_heads, self.head_k_dim),
                k.reshape(*shape, self.num_k_heads, self.head_k_dim),
                v.reshape(*shape, self.num_v_heads, self.head_v_dim))
