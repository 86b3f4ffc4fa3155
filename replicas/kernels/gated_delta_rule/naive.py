"""Gated delta rule, the PyTorch references (CPU path, and the spec for fla's Triton kernels).

Per value head, with a state S [K, V] carried token to token (Qwen3.5 / Qwen3-Next linear attention):

    S_t = exp(g_t) * S_{t-1}                         decay (g <= 0, log space)
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T   delta rule: write only what S does not already predict
    o_t = S_t^T (scale * q_t)

fla's signature and layout: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; HV a multiple of H,
query/key head h serving value heads h * HV/H .. (h + 1) * HV/H - 1 (transformers' repeat_interleave).
Packed varlen: B = 1 and cu_seqlens [N + 1] (int64); initial_state / final_state [N, HV, K, V].
Without cu_seqlens each of the B rows is a sequence (N = B).

Sequences are padded to a [N, HV, L, ...] batch, never looped over: a padded tail has g = 0 and beta = 0,
so it leaves the state exactly as the last real token left it.
All arithmetic is float32; o comes back in q's dtype, final_state in float32.
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # transformers' (and fla's chunk) form: x / sqrt(sum(x^2) + eps)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """One token at a time. -> (o [B, T, HV, V], final_state [N, HV, K, V] float32 or None)"""
    q, k, v, g, beta, state, scale, unpad = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                     use_qk_l2norm_in_kernel)
    o = torch.zeros_like(v)  # [N, HV, L, V]
    for t in range(v.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]  # [N, HV, K]
        predicted = torch.einsum("nhkv,nhk->nhv", state, k_t)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        o[:, :, t] = torch.einsum("nhkv,nhk->nhv", state, q[:, :, t] * scale)
    return unpad(o), (state if output_final_state else None)


def naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    """Chunks of chunk_size tokens: inside a chunk the delta-rule updates are solved at once (the WY / UT form),
    across chunks the state is carried. Same result as the recurrent form up to float rounding.
    -> (o [B, T, HV, V], final_state [N, HV, K, V] float32 or None)"""
    q, k, v, g, beta, state, scale, unpad = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                     use_qk_l2norm_in_kernel)
    length = v.shape[2]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q * scale, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    # [N, HV, C, BT, ...]: C chunks of BT = chunk_size tokens
    q, k, v = (x.unflatten(2, (-1, chunk_size)) for x in (q, k, v))
    g, beta = (x.unflatten(2, (-1, chunk_size)) for x in (g, beta))
    g_cum = g.cumsum(-1)  # log decay from the chunk start through position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(g_cum[i] - g_cum[j]) for j <= i, else 0
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly_lower(diag(beta) K K^T * decay)) [u, w] = [V beta, K beta exp(g_cum)]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, causal incl. the diagonal
    q_decayed = q * g_cum.exp()[..., None]  # reads the state carried into the chunk
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # position i's write, decayed to the chunk end
    o = torch.empty_like(v)
    for c in range(v.shape[2]):
        v_new = u[:, :, c] - w[:, :, c] @ state  # [N, HV, BT, V]: what the carried state does not predict
        o[:, :, c] = q_decayed[:, :, c] @ state + attn[:, :, c] @ v_new
        state = state * g_cum[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = o.flatten(2, 3)[:, :, :length]
    return unpad(o), (state if output_final_state else None)


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """-> q, k [N, HV, L, K], v [N, HV, L, V], g, beta [N, HV, L] float32 (zero-padded), the initial state
    [N, HV, K, V] float32, the scale, and unpad(o [N, HV, L, V]) -> [B, T, HV, V] in q's dtype."""
    batch, num_tokens, num_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[2], v.shape[3]
    assert k.shape == q.shape and v.shape[:2] == (batch, num_tokens) and num_v_heads % num_heads == 0
    assert g.shape == beta.shape == (batch, num_tokens, num_v_heads)
    dtype = q.dtype
    scale = head_k ** -0.5 if scale is None else scale
    group = num_v_heads // num_heads
    q, k = (x.float().repeat_interleave(group, dim=2) if group > 1 else x.float() for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    tensors = [q, k, v.float(), g.float(), beta.float()]
    if cu_seqlens is None:
        valid = None
    else:
        assert batch == 1, "cu_seqlens needs packed inputs, B = 1"
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
        steps = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=q.device)
        valid = steps[None, :] < lengths[:, None]  # [N, L]
        rows = torch.where(valid, cu_seqlens[:-1, None] + steps[None, :], 0)
        tensors = [x[0][rows] * _expand(valid, x[0].dim() + 1) for x in tensors]  # [N, L, ...]
    q, k, v, g, beta = (x.transpose(1, 2) for x in tensors)  # heads before time
    num_seqs = v.shape[0]
    if initial_state is None:
        state = torch.zeros(num_seqs, num_v_heads, head_k, head_v, dtype=torch.float32, device=v.device)
    else:
        assert initial_state.shape == (num_seqs, num_v_heads, head_k, head_v), initial_state.shape
        state = initial_state.float()

    def unpad(o: torch.Tensor) -> torch.Tensor:
        o = o.transpose(1, 2)  # [N, L, HV, V]
        return (o if valid is None else o[valid].unsqueeze(0)).to(dtype)

    return q, k, v, g, beta, state, scale, unpad


def _expand(mask: torch.Tensor, ndim: int) -> torch.Tensor:
    return mask.reshape(*mask.shape, *([1] * (ndim - mask.dim())))
