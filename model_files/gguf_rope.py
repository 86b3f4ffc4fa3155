"""GGUF rope metadata -> Hugging Face `rope_parameters`.

llama.cpp's converter (convert_hf_to_gguf.py, TextModel.set_gguf_parameters) writes
`{arch}.rope.scaling.type` / `.factor` / `.original_context_length` / `.yarn_*` for linear and
yarn scaling, but nothing at all for Llama 3's "llama3" scaling: LlamaModel.generate_extra_tensors
bakes it into a `rope_freqs.weight` tensor instead, one divisor per rotary frequency:

    wavelen < old/high             1                      (high frequencies: unscaled)
    wavelen > old/low              factor                 (low frequencies)
    otherwise                      1 / ((1 - s) / factor + s),  s = (old / wavelen - low) / (high - low)

with factor / low / high from rope_scaling and `old` read from the *top level* of config.json
(`original_max_position_embeddings`, default 8192; Llama 3.x keeps it inside rope_scaling, so
llama.cpp always used 8192). The divisors depend on (old, low, high) only through old/low and
old/high, so we recover one triple that regenerates the tensor, and refuse the file when none does:
serving it with a guessed rope would be silently wrong.

Phi-3's LongRoPE is tensors too (Phi3MiniModel.generate_extra_tensors): `rope_factors_long.weight` /
`rope_factors_short.weight`, one divisor per rotary frequency, HF's long_factor / short_factor as float32,
beside `rope.scaling.original_context_length` and `rope.scaling.attn_factor`; no `rope.scaling.type`.
"""

import math

import numpy as np
import torch

LLAMA3_DEFAULTS = (1.0, 4.0, 8192)  # low_freq_factor, high_freq_factor, old context: Llama 3.1-3.3's
RTOL = 1e-6  # the tensor is float32; a regenerated one matches it to rounding or not at all


def rope_parameters(field, arch: str, head_dim: int, rope_freqs: np.ndarray | None) -> dict:
    """HF rope_parameters from the GGUF's rope keys (`field(key, default)` reads one) and its
    `rope_freqs.weight` [head_dim / 2] float32, if any. Raises ValueError for a scaling HF cannot
    express exactly."""
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    kind = field(f"{arch}.rope.scaling.type", "none")
    factor = field(f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        if kind != "none":
            raise ValueError(f"GGUF has both rope_freqs and rope scaling {kind!r}; cannot tell which applies")
        return {"rope_theta": theta, **llama3_parameters(rope_freqs, theta, head_dim)}
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        return {"rope_theta": theta, **yarn_parameters(field, arch, factor)}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, yarn, llama3")


def yarn_parameters(field, arch: str, factor: float) -> dict:
    """HF's yarn keys from the ones llama.cpp writes for them; refuses llama.cpp-only knobs."""
    key = f"{arch}.rope.scaling."
    if field(key + "yarn_ext_factor", 1.0) != 1.0 or field(key + "yarn_log_multiplier", 0.0):
        raise ValueError("GGUF yarn rope with an extrapolation factor or log multiplier has no HF equivalent")
    original = field(key + "original_context_length")
    if original is None:
        raise ValueError("GGUF yarn rope without rope.scaling.original_context_length")
    params = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                             ("yarn_beta_slow", "beta_slow")):
        if (value := field(key + gguf_key)) is not None:
            params[hf_key] = float(value)
    return params


def llama3_parameters(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict:
    """The llama3 rope_parameters whose divisors are `rope_freqs`: Meta's (low 1, high 4, old 8192)
    when they fit, else a (low, high) fitted to the smoothed band with old 8192. Raises ValueError when
    neither regenerates `rope_freqs` [head_dim / 2]."""
    rope_freqs = np.asarray(rope_freqs, dtype=np.float32).reshape(-1)
    if rope_freqs.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has {rope_freqs.size} entries; expected head_dim / 2 = {head_dim // 2}")
    factor = float(rope_freqs.max())
    if np.all(rope_freqs == 1.0):
        return {"rope_type": "default"}
    fitted = fitted_band(rope_freqs, theta, head_dim, factor)
    # the fit to 6 digits first: configs hold round numbers, and the fit is off in the 8th
    candidates = [LLAMA3_DEFAULTS] + ([] if fitted is None else [tuple(float(f"{x:.6g}") for x in fitted), fitted])
    for low, high, old in candidates:
        if np.allclose(llama3_rope_freqs(theta, head_dim, factor, low, high, old), rope_freqs, rtol=RTOL, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(old)}
    raise ValueError("GGUF rope_freqs is not llama3 rope scaling that can be recovered exactly; "
                     f"refusing it (divisors {rope_freqs.min():.4g}..{factor:.4g})")


def fitted_band(rope_freqs: np.ndarray, theta: float, head_dim: int, factor: float):
    """(low, high, 8192) from the smoothed divisors, or None with fewer than two of them.

    In the band s = (old / wavelen - low) / (high - low) is linear in 1 / wavelen: s = a / wavelen - b
    with a = old / (high - low), b = low / (high - low)."""
    inv_wavelen = inverse_frequencies(theta, head_dim).numpy().astype(np.float64) / (2 * math.pi)
    band = (rope_freqs > 1.0 + RTOL) & (rope_freqs < factor * (1 - RTOL))
    if band.sum() < 2 or factor <= 1.0:
        return None
    s = (1.0 / rope_freqs[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, minus_b = np.polyfit(inv_wavelen[band], s, 1)
    old = LLAMA3_DEFAULTS[2]
    low, high = -minus_b * old / a, -minus_b * old / a + old / a
    return (float(low), float(high), old) if 0 < low < high else None


def inverse_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    # [head_dim / 2] float32, as llama.cpp's converter computes them
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama3_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """llama.cpp's rope_freqs for these llama3 parameters: [head_dim / 2] float32, in its float32 math."""
    wavelen = 2 * math.pi / inverse_frequencies(theta, head_dim)
    smooth = (old / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen > old / low, torch.tensor(factor, dtype=torch.float32), divisors)
    divisors = torch.where(wavelen < old / high, torch.tensor(1.0), divisors)
    return divisors.numpy()


def longrope_parameters(field, arch: str, head_dim: int, rotary_dim: int, long: np.ndarray | None,
                        short: np.ndarray | None, context: int, original: int) -> dict:
    """Phi-3's rope_parameters: partial rotary (`rotary_dim` of `head_dim`), and LongRoPE where the file has
    the factor tensors (`long`, `short`: [rotary_dim / 2] float32).

    llama.cpp writes attn_factor = sqrt(1 + ln(s) / ln(original)) for s = context / original > 1, else 1:
    what HF computes when attention_factor is absent, so it is kept only when the file's differs."""
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    kind = field(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "longrope"):
        raise ValueError(f"GGUF phi3 rope scaling {kind!r} is not supported; supported: none, longrope")
    partial = rotary_dim / head_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or int(head_dim * partial) != rotary_dim:
        raise ValueError(f"GGUF rope.dimension_count {rotary_dim} does not fit the head size {head_dim}")
    params = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    if long is None and short is None:
        return params
    if long is None or short is None or long.shape != (rotary_dim // 2,) or short.shape != (rotary_dim // 2,):
        raise ValueError(f"GGUF LongRoPE needs both rope_factors_long and rope_factors_short of {rotary_dim // 2} "
                         "entries (rope.dimension_count / 2)")
    params.update(rope_type="longrope", long_factor=long.tolist(), short_factor=short.tolist(),
                  original_max_position_embeddings=int(original))
    scale = context / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn_factor = field(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=RTOL):  # stored as float32
        params["attention_factor"] = float(attn_factor)
    return params
