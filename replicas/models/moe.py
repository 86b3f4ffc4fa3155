"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3.5-MoE: a router picks top-k experts per token,
the experts run as two grouped matmuls over the tokens routed to each, and Qwen3.5-MoE adds a gated shared expert.

Measured on the 2-core AVX-512 dev host, experts only, Qwen3-30B-A3B's shapes (hidden 2048, 768 per expert,
128 experts, top-8), ms of CPU time on 1 thread (other jobs made 2-thread wall times noise) at 1 / 8 / 256 tokens:

    grouped_mm over the sorted pairs (this)       f32  8.1 /  60 / 426    bf16  5.6 / 35 / 164
      bf16 with lone rows padded (this)                                   bf16  5.7 / 35 / 152
      f32 with every group padded to 4k rows      f32   13 /  93 / 389
    gather the chosen experts' weights + bmm      f32   81 / 670 / -      bf16   39 / 394 / -
    grouped_mm on [E, hidden, 2I]-contiguous      f32  6.5 /  50 / 425    bf16  8.4 / 53 / 206
    transformers' Python loop over experts        f32  7.9 /  62 / 406    bf16  5.4 / 37 / 139

Decode reads 8 experts' weights (~150 MB in f32) per call, so copying them (gather + bmm) costs ten times more;
one grouped path serves every size. The transposed layout would help f32 decode but costs bf16 more and is not
the checkpoint's; padding float32 groups (see `Experts.forward`) would cost 1.7x at decode.
"""

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels import fused_cpu
from replicas.kernels.cpu_linear.expert_native import expert_linear, native_experts
from replicas.models.layers import SwiGLU

# (token, expert) pairs up to which the native decode kernel runs (expert_gemv.cpp) where it is built: 8 decode
# rows at top-2. Above, the grouped matmul (whose per-expert GEMMs pay off once experts get many rows).
MAX_NATIVE_PAIRS = 16


class Experts(nn.Module):
    """All experts' weights in transformers 5's fused layout, so the fused names load as they are:
    gate_up_proj [E, 2I, hidden] (each expert's gate rows, then its up rows), down_proj [E, hidden, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.native = False  # decode-sized batches on the native kernel (use_native_experts)

    def checkpoint_shards(self, prefix: str) -> dict[str, tuple[nn.Parameter, tuple]]:
        """The hub's per-expert names -> (parameter, index into it); the loader copies each checkpoint
        tensor with `param.data[index].copy_(tensor)`. `prefix` is this module's path."""
        gate, up = slice(0, self.intermediate_size), slice(self.intermediate_size, 2 * self.intermediate_size)
        shards = {}
        for e in range(self.num_experts):
            shards[f"{prefix}.{e}.gate_proj.weight"] = (self.gate_up_proj, (e, gate))
            shards[f"{prefix}.{e}.up_proj.weight"] = (self.gate_up_proj, (e, up))
            shards[f"{prefix}.{e}.down_proj.weight"] = (self.down_proj, (e,))
        return shards

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; top_k_index: [T, K] int64; top_k_weights: [T, K] in x's dtype
        -> [T, hidden] float32: each token's experts' outputs, weighted and summed in k order.

        The (token, k) pairs are grouped by expert (a stable sort: ties keep token order) and each expert's
        rows go through one grouped matmul; empty experts cost nothing. A token must come out the same alone
        as in a batch, so nothing a row gets may depend on the other rows:
        - below float32 an expert's lone row gets a second, discarded row: torch rounds a one-row bf16 product
          differently from the oneDNN GEMM it runs for two or more rows (at a 2048-long reduction);
        - float32 is not padded: MKL rounds a row by how many share the call (one, or the last M % 4 of fewer
          than 12), so exactness would take groups of 4k rows, 1.7x the decode time, and the router's
          nn.Linear differs alone and batched anyway.
        """
        num_tokens, top_k = top_k_index.shape
        num_pairs = num_tokens * top_k
        if self.native and num_pairs <= MAX_NATIVE_PAIRS and x.device.type == "cpu":
            return self._native_decode(x, top_k_index, top_k_weights)
        expert_ids = top_k_index.reshape(-1)  # [N], (token, k) order
        order = torch.argsort(expert_ids, stable=True)  # [N]: sorted position -> pair
        counts = torch.bincount(expert_ids, minlength=self.num_experts)  # [E]
        pair_ids = torch.arange(num_pairs, device=x.device)
        row_of_pair = torch.empty_like(order).index_copy_(0, order, pair_ids)  # [N]: pair -> its row
        num_rows = counts
        if x.dtype != torch.float32:
            lone = (counts == 1).long()  # [E]
            num_rows = counts + lone
            row_of_pair += (lone.cumsum(0) - lone)[expert_ids]  # the padding rows of the experts before
        # int32 offsets: grouped_mm's contract; offs[e] is where expert e's rows end.
        offs = num_rows.cumsum(0, dtype=torch.int32)  # [E]
        # Padding rows read token 0; their outputs are never gathered.
        token_of_row = order.new_zeros(int(offs[-1])).index_copy_(0, row_of_pair, pair_ids // top_k)  # [R]
        gate_up = F.grouped_mm(x[token_of_row], self.gate_up_proj.transpose(1, 2), offs=offs)  # [R, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        product = F.silu(gate.float()).mul_(up).to(x.dtype)  # [R, I]: one rounding, as SwiGLU
        out_rows = F.grouped_mm(product, self.down_proj.transpose(1, 2), offs=offs)  # [R, hidden]
        # A sum over k per token, in k order: it cannot depend on the batch (an index_add over the
        # grouped rows would add in expert order).
        out = out_rows[row_of_pair].view(num_tokens, top_k, x.shape[-1])  # [T, K, hidden]
        return (out.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1)  # [T, hidden]


    def _native_decode(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Each pair times its expert on the native kernel: a pair's result depends on nothing else in the
        batch (alone = batched, bitwise), and only the chosen experts' weights are read, once per pair. Few
        ops (each costs microseconds at this size): pairs in (token, k) order, unsorted (pairs that share an
        expert find its rows in cache anyway), the fused SiLU-and-mul where built. Shapes as forward."""
        num_tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)  # [N], (token, k) order
        x_pairs = x.unsqueeze(1).expand(num_tokens, top_k, x.shape[-1]).reshape(-1, x.shape[-1])  # [N, hidden]
        gate_up = expert_linear(x_pairs, self.gate_up_proj, expert_ids)  # [N, 2I] float32
        product = silu_and_mul(gate_up, x.dtype)  # [N, I]: one rounding, as SwiGLU
        out = expert_linear(product, self.down_proj, expert_ids).view(num_tokens, top_k, -1)  # float32
        return (out * top_k_weights.float().unsqueeze(-1)).sum(dim=1)  # [T, hidden], summed in k order


def use_native_experts(model: nn.Module) -> int:
    """Turns the native decode kernel on in every Experts module, where it is built; returns how many."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts or native_experts() is None:
        return 0
    for module in experts:
        module.native = True
    return len(experts)


def silu_and_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I] in float32, rounded once to dtype: the fused op where it is built."""
    if fused_cpu.fused_ops() is not None:
        return fused_cpu.silu_and_mul(gate_up, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up).to(dtype)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP (and Qwen3.5-MoE's, with its shared expert).

    1. router: logits in x's dtype, softmax in float32, top-k, renormalised when `norm_topk_prob`,
       the weights cast to x's dtype (transformers' Qwen3MoeTopKRouter);
    2. experts: `Experts.forward`, summed in float32;
    3. shared expert (shared_expert_intermediate_size > 0): + sigmoid(shared_expert_gate(x)) * shared_expert(x);
    4. one rounding to x's dtype (transformers rounds after each sum; equal in float32).
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int = 0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size)
        if shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLU(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden], x's dtype
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        top_k_weights, top_k_index = torch.topk(probs, self.top_k, dim=-1)  # [T, K] each
        if self.norm_topk_prob:
            top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_k_index, top_k_weights.to(x.dtype))  # [T, hidden] float32
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.to(x.dtype)
