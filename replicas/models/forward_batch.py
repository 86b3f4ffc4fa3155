"""ForwardBatch: the per-step tensors the engine builds once (replicas/engine/batch_builder.py) and every
layer reads. It lives with the models, the model's input, so the models never import the engine."""

from dataclasses import dataclass

import torch

from replicas.kernels.paged_attention import AttentionGroup


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, every scheduled token of the step, sequence after sequence
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot each token writes
    cu_seqlens: torch.Tensor  # [S + 1] int64, query rows of sequence s are cu_seqlens[s]:cu_seqlens[s+1]
    groups: list[AttentionGroup] | None  # the PyTorch path's decode rows / prefill chunks; None: native attention
    logits_indices: torch.Tensor  # [R] int64, rows whose next token is sampled this step
    query_start_loc: torch.Tensor | None = None  # [S + 1] int32, cu_seqlens for the native attention op
    seq_lens: torch.Tensor | None = None  # [S] int32, keys of sequence s after this step
    block_table: torch.Tensor | None = None  # [S, N] int32, sequence s's KV blocks (padded with 0)
    # Images (M-RoPE models): every token's (t, h, w) positions, set when a scheduled sequence has images.
    mrope_positions: torch.Tensor | None = None  # [3, T] int64
    # Image tokens of the step: their rows and the vision features that replace their embeddings.
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [K] int64, features [K, hidden]
    # engine.batch_invariant: every kernel reduces each row in an order that depends on that row alone
    batch_invariant: bool = False
