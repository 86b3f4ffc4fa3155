"""ForwardBatch: the per-step tensors the model runner builds once and every layer reads."""

from dataclasses import dataclass

import torch

from replicas.kernels.paged_attention import AttentionGroup


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, every scheduled token of the step, sequence after sequence
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot each token writes
    cu_seqlens: torch.Tensor  # [S + 1] int64, query rows of sequence s are cu_seqlens[s]:cu_seqlens[s+1]
    groups: list[AttentionGroup]  # decode rows, prefill chunks (at most two)
    logits_indices: torch.Tensor  # [R] int64, rows whose next token is sampled this step
