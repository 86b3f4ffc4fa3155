"""The native Gated DeltaNet core (replicas/kernels/gated_delta_rule/cpu_gated_delta.cpp) against its PyTorch
references: the conv against naive_causal_conv1d, the delta rule against naive_recurrent_gated_delta_rule, and
a whole GatedDeltaNet layer's step (decode rows and prefill chunks mixed, states in slots) native vs PyTorch,
at the head counts of the published configs, float32 and bf16. Then what only the native path promises: a
sequence's states and outputs are the same bits however its tokens were split into steps, and whatever else
the step holds.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from replicas.kernels.causal_conv1d import naive_causal_conv1d
from replicas.kernels.gated_delta_rule import naive_recurrent_gated_delta_rule
from replicas.kernels.gated_delta_rule.cpu_native import conv1d_silu_step, gated_delta_step, native_gated_delta
from replicas.models.gated_deltanet import (GatedDeltaNet, allocate_linear_states, make_linear_state_batch,
                                            use_native_recurrent)

pytestmark = pytest.mark.skipif(native_gated_delta() is None, reason="the native gated delta ops did not build")

# (H, HV, K, V): Qwen3.5-0.8B/2B/9B and Qwen3.5-MoE (16, 16 | 32 | 64, 128, 128) scaled to a test's budget, and
# the awkward ones: GQA-like HV > H, dims that are not a vector's multiple.
HEADS = {"qwen3_5-0_8b": (16, 16, 128, 128), "qwen3_next": (2, 4, 128, 128), "odd": (2, 6, 24, 40)}


def rms_ratio(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return ((ref - got).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-12)).item()


def packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [2, 1, 7], [130, 1, 3]], ids=["one-token", "short", "long"])
def test_conv_matches_reference(lengths, dtype):
    channels, width = 200, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen)
    states = torch.randn(len(lengths), channels, width - 1, generator=gen).to(dtype)
    has = torch.tensor([i % 2 == 0 for i in range(len(lengths))])
    cu = packed(lengths)
    ref, ref_states = naive_causal_conv1d(x, weight, None, cu, torch.where(has[:, None, None], states, 0),
                                          output_final_state=True, activation="silu")
    slots = torch.arange(len(lengths)).flip(0)  # slots need not follow the sequences' order
    pool = torch.zeros(len(lengths), channels, width - 1, dtype=dtype)
    pool[slots] = states
    got = conv1d_silu_step(x, weight.t().contiguous(), cu, slots, has, pool)
    assert rms_ratio(ref.float(), got.float()) <= (1e-6 if dtype == torch.float32 else 8e-3)
    assert torch.equal(pool[slots], ref_states)  # the state is the inputs themselves: exact


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [65, 1, 9]], ids=["decode-1", "decode-3", "mixed"])
def test_delta_rule_matches_reference(heads, lengths):
    num_heads, num_v_heads, head_k, head_v = heads
    gen = torch.Generator().manual_seed(1)
    total, key_dim = sum(lengths), num_heads * head_k
    y = torch.randn(total, 2 * key_dim + num_v_heads * head_v, generator=gen)
    a, b = torch.randn(total, num_v_heads, generator=gen), torch.randn(total, num_v_heads, generator=gen)
    decay_rate, dt_bias = torch.rand(num_v_heads, generator=gen) + 0.1, torch.randn(num_v_heads, generator=gen)
    h0 = torch.randn(len(lengths), num_v_heads, head_k, head_v, generator=gen)
    has = torch.tensor([i % 2 == 1 for i in range(len(lengths))])
    cu = packed(lengths)
    q, k, v = y.split([key_dim, key_dim, num_v_heads * head_v], dim=-1)
    g = -decay_rate * F.softplus(a + dt_bias)
    ref, ref_state = naive_recurrent_gated_delta_rule(
        q.reshape(1, total, num_heads, head_k), k.reshape(1, total, num_heads, head_k),
        v.reshape(1, total, num_v_heads, head_v), g[None], b.sigmoid()[None],
        initial_state=torch.where(has[:, None, None, None], h0, 0), output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True)
    state = h0.clone()
    z = torch.empty(total, num_v_heads, head_v)
    got = gated_delta_step(y, a, b, z, decay_rate, dt_bias, None, 1e-6, cu, torch.arange(len(lengths)), has, state,
                           num_heads, head_k ** -0.5)
    assert rms_ratio(ref[0], got) <= 2e-6
    assert rms_ratio(ref_state, state) <= 2e-6


def make_layer(heads, dtype, seed=0) -> GatedDeltaNet:
    num_heads, num_v_heads, head_k, head_v = heads
    config = SimpleNamespace(linear_num_key_heads=num_heads, linear_num_value_heads=num_v_heads,
                             linear_key_head_dim=head_k, linear_value_head_dim=head_v, linear_conv_kernel_dim=4,
                             hidden_size=64, rms_norm_eps=1e-6, layer_types=["linear_attention"])
    torch.manual_seed(seed)
    layer = GatedDeltaNet(config)
    with torch.no_grad():  # trained-looking gates: decays near 1, noise on what inits at constants
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() > 1 else 1.0))
        layer.A_log.copy_(torch.rand_like(layer.A_log).log())
    return layer.to(dtype).eval(), config


def run_step(layer, config, x, lengths, slots, has, states) -> torch.Tensor:
    cu = packed(lengths)
    step = make_linear_state_batch(states, cu, torch.tensor(slots), torch.tensor(has))
    with torch.inference_mode():
        return layer(x, cu, states[0], step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_layer_native_matches_pytorch(heads, dtype):
    """One step of decode rows and prefill chunks, slots holding earlier state, both paths from the same slots."""
    layer, config = make_layer(heads, dtype)
    lengths, slots, has = [1, 37, 1, 70], [3, 0, 2, 1], [True, True, False, False]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lengths), 64, generator=gen).to(dtype)
    pools = []
    for native in (False, True):
        states = allocate_linear_states(config, 4, dtype, torch.device("cpu"))
        torch.manual_seed(3)
        states[0].conv_state.normal_()
        states[0].recurrent_state.normal_(std=0.1)
        layer.native = None
        if native:
            assert use_native_recurrent(layer) == 1
        pools.append((run_step(layer, config, x, lengths, slots, has, states), states[0]))
    (ref, ref_state), (got, got_state) = pools
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rms_ratio(ref.float(), got.float()) <= tol
    assert torch.equal(ref_state.conv_state, got_state.conv_state)
    assert rms_ratio(ref_state.recurrent_state, got_state.recurrent_state) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_states_are_exact_across_chunkings_and_batches(dtype):
    """A 160-token turn as one chunk, as chunks of 64 | 1 | 60 | 35 beside another sequence, and token by token:
    the core's output rows and the states the same bits. (The projections around the core are the linears'
    business: batch_invariant makes those row-count independent.)"""
    layer, config = make_layer(HEADS["qwen3_next"], dtype)
    use_native_recurrent(layer)
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():  # the projections of both sequences' rows, once: [T, ...] each
        x, other = (torch.randn(n, 64, generator=gen).to(dtype) for n in (160, 7))
        inputs, rider = ([layer.in_proj_qkv(t), layer.in_proj_z(t).view(len(t), 4, 128), layer.in_proj_a(t),
                          layer.in_proj_b(t)] for t in (x, other))
    results = []
    for splits in ([160], [64, 1, 60, 35], [1] * 160):
        states = allocate_linear_states(config, 2, dtype, torch.device("cpu"))
        rows, done = [], 0
        for i, n in enumerate(splits):
            part = [t[done:done + n] for t in inputs]
            if i % 2:  # the other sequence rides along in slot 0 on every other step
                part = [torch.cat([r, p]) for r, p in zip(rider, part)]
            lengths, slots, has = ([7, n], [0, 1], [False, done > 0]) if i % 2 else ([n], [1], [done > 0])
            cu = packed(lengths)
            step = make_linear_state_batch(states, cu, torch.tensor(slots), torch.tensor(has))
            with torch.inference_mode():
                rows.append(layer._native_core(*part, cu, states[0], step)[-n:])
            done += n
        results.append((torch.cat(rows), states[0].conv_state[1].clone(), states[0].recurrent_state[1].clone()))
    for out, conv, recurrent in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(conv, results[0][1])
        assert torch.equal(recurrent, results[0][2])


def test_no_step_runs_every_sequence_from_zeros():
    """Without a step (no slots) the native path uses scratch states: the same as slots that start empty."""
    layer, config = make_layer(HEADS["odd"], torch.float32)
    use_native_recurrent(layer)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    cu = packed([5, 7])
    with torch.inference_mode():
        alone = layer(x, cu)
    states = allocate_linear_states(config, 2, torch.float32, torch.device("cpu"))
    assert torch.equal(alone, run_step(layer, config, x, [5, 7], [0, 1], [False, False], states))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snapshots_are_the_states_a_shorter_step_leaves(dtype):
    """Snapshots after rows inside a step (two in one sequence, one in another, one at a sequence's first
    token) hold exactly what the slots hold when the step ends at those tokens."""
    layer, config = make_layer(HEADS["odd"], dtype)
    use_native_recurrent(layer)
    gen = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        x = torch.randn(30, 64, generator=gen).to(dtype)
        inputs = [layer.in_proj_qkv(x), layer.in_proj_z(x).view(30, 6, 40), layer.in_proj_a(x), layer.in_proj_b(x)]
    lengths, rows = [17, 13], [0, 4, 16, 20]  # sequence 0: after its 1st, 5th, 17th token; sequence 1: its 4th
    states = allocate_linear_states(config, 2, dtype, torch.device("cpu"))
    step = make_linear_state_batch(states, packed(lengths), torch.tensor([0, 1]), torch.tensor([False, False]), rows)
    with torch.inference_mode():
        layer._native_core(*inputs, packed(lengths), states[0], step, step.snapshots[0])
    for j, (seq, upto) in enumerate([(0, 1), (0, 5), (0, 17), (1, 4)]):
        fresh = allocate_linear_states(config, 1, dtype, torch.device("cpu"))
        start = 0 if seq == 0 else 17
        part = [t[start:start + upto] for t in inputs]
        alone = make_linear_state_batch(fresh, packed([upto]), torch.tensor([0]), torch.tensor([False]))
        with torch.inference_mode():
            layer._native_core(*part, packed([upto]), fresh[0], alone)
        assert torch.equal(step.snapshots[0].conv_state[j], fresh[0].conv_state[0])
        assert torch.equal(step.snapshots[0].recurrent_state[j], fresh[0].recurrent_state[0])
