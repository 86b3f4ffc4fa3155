"""The native MoE expert kernel (replicas/kernels/cpu_linear/expert_native.py) against its reference, and
SparseMoeBlock's decode path on it: the grouped-matmul path's results, and a token alone = in its batch."""

import pytest
import torch

from replicas.kernels.cpu_linear.expert_native import expert_linear, naive_expert_linear, native_experts
from replicas.models.moe import MAX_NATIVE_PAIRS, SparseMoeBlock, use_native_experts

needs_native = pytest.mark.skipif(native_experts() is None, reason="the native expert kernel could not be built "
                                  "on this host (baseline ISA, TETHER_NATIVE=0, or no compiler / ninja: see the log)")
TOLERANCE = 1e-5  # float32 sums, measured against the sum of |x| |w| (which bounds every rounding)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_pairs,n,k", [(1, 1024, 512), (16, 96, 512), (3, 37, 70), (5, 8, 17), (0, 8, 16)])
def test_matches_the_reference(dtype, num_pairs, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(6, n, k, generator=g).to(dtype)
    x = torch.randn(num_pairs, k, generator=g).to(dtype)
    ids = torch.randint(0, 6, (num_pairs,), generator=g)
    out = expert_linear(x, w, ids)
    ref = torch.bmm(w[ids].double(), x.double().unsqueeze(-1)).squeeze(-1)
    bound = torch.bmm(w[ids].double().abs(), x.double().abs().unsqueeze(-1)).squeeze(-1)
    assert out.shape == (num_pairs, n) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= TOLERANCE * bound + 1e-30).all()
    assert torch.allclose(out, naive_expert_linear(x, w, ids), atol=1e-4, rtol=1e-5)


@needs_native
def test_a_pair_does_not_depend_on_the_others_and_bad_ids_are_refused():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 64, 128, generator=g).bfloat16(), torch.randn(9, 128, generator=g)
    ids = torch.tensor([3, 0, 3, 1, 2, 2, 0, 1, 3])
    batch = expert_linear(x, w, ids)
    for p in range(9):
        assert torch.equal(expert_linear(x[p:p + 1], w, ids[p:p + 1])[0], batch[p])
    with pytest.raises(RuntimeError, match="out of range"):
        expert_linear(x[:1], w, torch.tensor([4]))


def moe_block(dtype: torch.dtype, shared: int) -> SparseMoeBlock:
    torch.manual_seed(1)
    block = SparseMoeBlock(64, 32, 8, 2, norm_topk_prob=True, shared_expert_intermediate_size=shared)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.to(dtype).eval()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 48])
def test_moe_decode_on_the_native_kernel(dtype, shared):
    block = moe_block(dtype, shared)
    x = torch.randn(MAX_NATIVE_PAIRS // 2, 64).to(dtype)  # 8 decode rows, top-2: the native path's limit
    with torch.inference_mode():
        grouped = block(x)
        assert use_native_experts(block) == 1
        native = block(x)
        alone = [block(x[t:t + 1]) for t in range(x.shape[0])]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the grouped path rounds its matmuls to bf16
    assert torch.allclose(native.float(), grouped.float(), atol=tolerance, rtol=tolerance)
    for t in range(x.shape[0]):  # float32: the router's one-row matmul (MKL) rounds apart from the batched one
        assert torch.equal(alone[t][0], native[t]) if dtype == torch.bfloat16 else \
            torch.allclose(alone[t][0], native[t], atol=1e-5, rtol=1e-5)
