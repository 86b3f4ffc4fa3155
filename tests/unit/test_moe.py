"""SparseMoeBlock (replicas/models/moe.py) against transformers' Qwen3-MoE and Qwen3.5-MoE blocks, loaded through
the hub's per-expert names; a token alone against the same token in a batch; experts that get no tokens."""

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from replicas.models.layers import MergedLinear
from replicas.models.moe import Experts, SparseMoeBlock

HIDDEN, MOE_INTERMEDIATE, SHARED_INTERMEDIATE = 64, 32, 48
VARIANTS = {  # id -> (shared expert, norm_topk_prob); Qwen3.5-MoE always renormalises
    "qwen3_moe": (False, True), "qwen3_moe-unnormalised": (False, False), "qwen3_5_moe": (True, True)}


def reference_block(shared: bool, norm_topk_prob: bool, num_experts: int = 8, top_k: int = 2) -> nn.Module:
    sizes = dict(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTERMEDIATE, num_experts=num_experts,
                 num_experts_per_tok=top_k)
    if shared:
        config = Qwen3_5MoeTextConfig(**sizes, shared_expert_intermediate_size=SHARED_INTERMEDIATE)
    else:
        config = Qwen3MoeConfig(**sizes, norm_topk_prob=norm_topk_prob)
    config._experts_implementation = "eager"  # transformers' loop over experts: the spec
    block = (Qwen3_5MoeSparseMoeBlock if shared else Qwen3MoeSparseMoeBlock)(config)
    with torch.no_grad():
        for param in block.parameters():  # created empty (experts) or zero (router)
            param.normal_(0, 0.1)
    return block


def our_block(shared: bool, norm_topk_prob: bool, num_experts: int = 8, top_k: int = 2,
              moe_intermediate: int = MOE_INTERMEDIATE) -> SparseMoeBlock:
    return SparseMoeBlock(HIDDEN, moe_intermediate, num_experts, top_k, norm_topk_prob,
                          SHARED_INTERMEDIATE if shared else 0)


def hub_checkpoint(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's weights under the hub's names: experts one by one, gate_proj / up_proj / down_proj."""
    checkpoint = dict(reference.state_dict())
    gate_up, down = checkpoint.pop("experts.gate_up_proj"), checkpoint.pop("experts.down_proj")  # [E, 2I, H], [E, H, I]
    for e in range(gate_up.shape[0]):
        checkpoint[f"experts.{e}.gate_proj.weight"] = gate_up[e, :MOE_INTERMEDIATE]
        checkpoint[f"experts.{e}.up_proj.weight"] = gate_up[e, MOE_INTERMEDIATE:]
        checkpoint[f"experts.{e}.down_proj.weight"] = down[e]
    return checkpoint


def load(block: nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    """As the loader does: names from `checkpoint_shards` and MergedLinear shards go to their index in the
    fused parameter (`param.data[index].copy_`), every other name to the parameter of that name. Every
    checkpoint name must have a target and every parameter must be written."""
    targets = {}
    for name, module in block.named_modules():
        if hasattr(module, "checkpoint_shards"):
            targets.update(module.checkpoint_shards(name))
        if isinstance(module, MergedLinear):
            parent = name.rpartition(".")[0]
            targets.update({f"{parent}.{shard}.weight": (module.weight, (module.shard_rows(shard),))
                            for shard in module.shards})
    sharded = {id(param) for param, _ in targets.values()}
    targets.update({name: (param, ()) for name, param in block.named_parameters() if id(param) not in sharded})
    assert set(checkpoint) == set(targets)
    with torch.no_grad():
        for param in block.parameters():
            param.fill_(float("nan"))
        for name, tensor in checkpoint.items():
            param, index = targets[name]
            param.data[index].copy_(tensor)
        assert not any(param.isnan().any() for param in block.parameters())


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_matches_transformers(variant, num_tokens):
    torch.manual_seed(num_tokens)
    reference, ours = reference_block(*VARIANTS[variant]), our_block(*VARIANTS[variant])
    load(ours, hub_checkpoint(reference))
    x = torch.randn(num_tokens, HIDDEN)
    with torch.no_grad():
        expected, out = reference(x.unsqueeze(0)).squeeze(0), ours(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_is_as_close_to_float32_as_transformers(variant):
    # Both in bf16 against float32 on the same (bf16) weights: we round the experts' sum and the shared
    # expert's once, transformers after each addition, so ours may differ from its, but not be worse.
    torch.manual_seed(5)
    reference, ours = reference_block(*VARIANTS[variant]), our_block(*VARIANTS[variant])
    load(ours, hub_checkpoint(reference))
    x = torch.randn(40, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        truth = reference.to(torch.bfloat16).float()(x.float().unsqueeze(0)).squeeze(0)
        expected = reference.to(torch.bfloat16)(x.unsqueeze(0)).squeeze(0)
        out = ours.to(torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    our_error, their_error = (out.float() - truth).abs(), (expected.float() - truth).abs()
    assert our_error.mean() <= their_error.mean() and our_error.max() <= 1.25 * their_error.max()


def test_transformers_fused_names_load_as_they_are():
    torch.manual_seed(0)
    reference, ours = reference_block(False, True), our_block(False, True)
    ours.load_state_dict(reference.state_dict())  # strict: experts.gate_up_proj, experts.down_proj, gate.weight
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        assert torch.allclose(ours(x), reference(x.unsqueeze(0)).squeeze(0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [0, 1, 3])
@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_5_moe"])
def test_most_experts_empty(variant, num_tokens):
    # 64 experts, top-2 of at most 3 tokens: 58 or more experts get no rows (all of them at T = 0).
    torch.manual_seed(7)
    reference = reference_block(*VARIANTS[variant], num_experts=64)
    ours = our_block(*VARIANTS[variant], num_experts=64)
    load(ours, hub_checkpoint(reference))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(num_tokens, HIDDEN, dtype=dtype)
        with torch.no_grad():
            out = ours.to(dtype)(x)
            expected = reference.to(dtype)(x.unsqueeze(0)).squeeze(0) if num_tokens else out
        assert out.shape == (num_tokens, HIDDEN) and out.dtype == dtype
        assert torch.allclose(out.float(), expected.float(), rtol=2e-2 if dtype == torch.bfloat16 else 0,
                              atol=2e-3 if dtype == torch.bfloat16 else 1e-5)


def random_block(shared: bool, dtype: torch.dtype) -> SparseMoeBlock:
    # Top-4 of 16, so that a token's sum over k has more than one order. Intermediate 64: torch leaves bf16
    # products of at most 16^3 multiply-adds to its own kernel, not oneDNN's, which rounds differently;
    # a padded lone row (2 x 64 x 64) stays above that.
    torch.manual_seed(11)
    block = our_block(shared, True, num_experts=16, top_k=4, moe_intermediate=64)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.1)
    return block.to(dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["qwen3_moe", "qwen3_5_moe"])
def test_bfloat16_token_alone_equals_its_row_in_a_batch(shared):
    # At hidden 64 the router's and the shared expert's one-row products are exact; at 2048 a one-row bf16
    # nn.Linear can round differently from a batched one, here as in every dense layer.
    block = random_block(shared, torch.bfloat16)
    x = torch.randn(37, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        batched = block(x)
        for i in range(len(x)):
            assert torch.equal(block(x[i:i + 1])[0], batched[i]), i


def test_bfloat16_experts_alone_equal_their_rows_in_a_batch():
    # The experts only, on fixed routing, at Qwen3-MoE's hidden size: torch's one-row bf16 product rounds
    # differently from its many-row one at a 2048-long reduction (not at 64), which the lone-row padding hides.
    torch.manual_seed(3)
    experts = Experts(16, 2048, 128)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(37, 2048, dtype=torch.bfloat16)
    top_k_weights, top_k_index = torch.rand(37, 4).to(torch.bfloat16), torch.randperm(16)[:4].repeat(37, 1)
    top_k_index[::3] = torch.randint(16, (13, 4))  # some experts get one row, some many
    with torch.no_grad():
        batched = experts(x, top_k_index, top_k_weights)
        for i in range(len(x)):
            assert torch.equal(experts(x[i:i + 1], top_k_index[i:i + 1], top_k_weights[i:i + 1])[0], batched[i]), i


@pytest.mark.parametrize("shared", [False, True], ids=["qwen3_moe", "qwen3_5_moe"])
def test_float32_token_alone_equals_its_row_in_a_batch_within_rounding(shared):
    # Not bitwise: MKL's float32 GEMM rounds a row by how many rows share the call (one, or the last M % 4 of
    # fewer than 12); the router's nn.Linear is one such call, which no grouping of the experts can fix.
    block = random_block(shared, torch.float32)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        batched = block(x)
        alone = torch.cat([block(x[i:i + 1]) for i in range(len(x))])
    assert torch.allclose(alone, batched, rtol=0, atol=1e-6)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
