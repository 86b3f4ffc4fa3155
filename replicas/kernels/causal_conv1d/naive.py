"""Causal depthwise conv1d over a packed varlen batch, the PyTorch references.

Channel c of output token t of a sequence sees that sequence's last W inputs, the W - 1 before t coming from
its conv state when the sequence continues an earlier step:

    state (W - 1 cols) | this step's tokens
    [ s0 s1 s2 ]       [ x0 x1 x2 x3 x4 ]        W = 4
      \___________________/                      y1 = act(sum_j weight[:, j] * window[j] + bias)
    final state = the last W - 1 columns of state | tokens:  [ x2 x3 x4 ]

x [T, C] packed, sequence after sequence (cu_seqlens [N + 1] int64); weight [C, W] (the checkpoint's
conv1d.weight [C, 1, W] squeezed); states [N, C, W - 1] in x's dtype. Arithmetic in float32.
The activation is applied inside, as transformers' causal_conv1d_fn / causal_conv1d_update do.
"""

import torch
import torch.nn.functional as F


def naive_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        cu_seqlens: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                        output_final_state: bool = False, activation: str | None = None):
    """-> (y [T, C] in x's dtype, final_states [N, C, W - 1] or None). Without cu_seqlens x is one sequence.
    Sequences are right-padded to one [N, C, W - 1 + L] batch; no loop over sequences."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int64, device=x.device)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
    num_seqs = lengths.numel()
    steps = torch.arange(int(lengths.max()) if num_seqs else 0, device=x.device)
    valid = steps[None, :] < lengths[:, None]  # [N, L]
    rows = torch.where(valid, cu_seqlens[:-1, None] + steps[None, :], 0)
    tokens = (x.float()[rows] * valid[..., None]).transpose(1, 2)  # [N, C, L]
    if initial_states is None:
        history = tokens.new_zeros(num_seqs, channels, width - 1)
    else:
        assert initial_states.shape == (num_seqs, channels, width - 1), initial_states.shape
        history = initial_states.float()
    window = torch.cat([history, tokens], dim=-1)  # [N, C, W - 1 + L]
    y = F.conv1d(window, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=channels)
    y = _activate(y, activation).transpose(1, 2)[valid]  # [T, C]
    final = None
    if output_final_state:
        cols = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]  # [N, W - 1]
        final = window.gather(2, cols[:, None, :].expand(-1, channels, -1)).to(x.dtype)
    return y.to(x.dtype), final


def naive_causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None, activation: str | None = None):
    """One new token per sequence (decode). x: [N, C]; conv_state: [N, C, W - 1]
    -> (y [N, C], new conv_state [N, C, W - 1]); conv_state itself is not modified."""
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=-1)  # [N, C, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:].to(conv_state.dtype)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation {activation!r} is not supported")
