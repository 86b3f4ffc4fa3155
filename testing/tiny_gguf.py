"""Tiny GGUF files of llama / qwen2 / qwen3 / qwen3moe / gemma3 / phi3 decoders, in any tensor type, with
SmolLM2's tokenizer.

`write_tiny_gguf` writes one with the gguf package's GGUFWriter the way llama.cpp's convert_hf_to_gguf.py lays
it out (every tensor name checked against gguf-py's own table for the architecture), and returns the reference
weights: transformers' parameter names -> float32, built from gguf.quants.dequantize of the very bytes written,
with llama.cpp's changes undone here, independently of replicas/models/gguf*.py:
  llama      Q/K rows permuted per head (LlamaModel.permute)
  gemma3     1 added to every norm weight (Gemma3Model.modify_tensors: HF scales by 1 + w)
  phi3       q|k|v and gate|up fused, as the HF checkpoint has them (attn_qkv, ffn_up)
  qwen3moe   experts stacked [E, I, H] / [E, H, I]; the reference fuses gate|up as transformers 5 holds them
The metadata follows each converter class: the HF-side values are GEMMA3 / PHI3 / QWEN3MOE below.

Tensor bytes per type:
  F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1   random normal weights through gguf.quants.quantize
  Q4_K / Q5_K / Q6_K / Q2_K / IQ2_XS                    random block bytes (the package cannot quantize them),
                                                        their f16 scales (d, dmin) set to small finite values
K-quants pack 256-wide super-blocks along a row, so every K-quant matrix's row length is a multiple of 256:
hidden 256, intermediate 512, 4 heads (2 KV) of 64 (gemma3: of 128).
"""

import math
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=16384, rms_norm_eps=1e-5)
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "qwen3moe": 1000000.0,
              "gemma3": 1000000.0, "phi3": 10000.0}
# qwen: llama.cpp's name for its split; gemma3 / phi3 files carry SPM or gpt-4o vocabularies, here SmolLM2's
PRE_TOKENIZER = {"llama": "smollm", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2", "gemma3": "smollm",
                 "phi3": "smollm"}
WINDOW = 16  # sliding windows shorter than the test prompt (37 tokens)
# 6 layers: llama.cpp's default pattern makes layer 5 the global one; its key_length 128 is not hidden / heads
GEMMA3 = dict(num_hidden_layers=6, sliding_window=WINDOW, rope_scaling_factor=8.0, local_rope_theta=10000.0)
# Phi-4-mini's partial rotary (0.75); LongRoPE factors exact in float32, as the file stores them
PHI3 = dict(partial_rotary_factor=0.75, max_position_embeddings=512, original_max_position_embeddings=128,
            sliding_window=WINDOW, short_factor=[1.0 + 0.125 * i for i in range(24)],
            long_factor=[1.0 + 0.75 * i for i in range(24)])
QWEN3MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
WEIGHT_STD = 0.03
# Byte offset of each f16 scale in a block, and its size: weights come out ~0.03 (gguf/quants.py layouts).
F16_SCALES = {
    T.Q4_K: {0: 1e-4, 2: 7.5e-4},  # d, dmin: w = d * sc * q - dmin * m, q in 0..15, sc / m in 0..63
    T.Q5_K: {0: 6e-5, 2: 9e-4},  # q in 0..31
    T.Q6_K: {208: 2e-5},  # w = d * sc * (q - 32), sc int8
    T.Q2_K: {80: 3e-4, 82: 3e-4},
    T.IQ2_XS: {0: 1e-3},
}


def sizes(arch: str, head_dim: int) -> dict:
    """TINY with the architecture's own sizes."""
    extra = {"gemma3": dict(num_hidden_layers=GEMMA3["num_hidden_layers"]),
             "phi3": dict(max_position_embeddings=PHI3["max_position_embeddings"])}.get(arch, {})
    return {**TINY, "head_dim": head_dim, **extra}


def layer_tensors(arch: str, i: int, c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (transformers name, shape as torch holds it) for layer i of a model of sizes `c`."""
    q_rows, kv_rows = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, f, p = c["hidden_size"], c["intermediate_size"], f"model.layers.{i}."
    names = {f"blk.{i}.attn_norm.weight": (p + "input_layernorm.weight", (h,)),
             f"blk.{i}.attn_output.weight": (p + "self_attn.o_proj.weight", (h, q_rows)),
             f"blk.{i}.ffn_norm.weight": (p + "post_attention_layernorm.weight", (h,))}
    if arch == "phi3":
        names[f"blk.{i}.attn_qkv.weight"] = (p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, h))
        names[f"blk.{i}.ffn_up.weight"] = (p + "mlp.gate_up_proj.weight", (2 * f, h))
        names[f"blk.{i}.ffn_down.weight"] = (p + "mlp.down_proj.weight", (h, f))
        return names
    for x, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        names[f"blk.{i}.attn_{x}.weight"] = (p + f"self_attn.{x}_proj.weight", (rows, h))
        if arch == "qwen2":
            names[f"blk.{i}.attn_{x}.bias"] = (p + f"self_attn.{x}_proj.bias", (rows,))
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        for x in ("q", "k"):
            names[f"blk.{i}.attn_{x}_norm.weight"] = (p + f"self_attn.{x}_norm.weight", (c["head_dim"],))
    if arch == "qwen3moe":
        e, fe = QWEN3MOE["num_experts"], QWEN3MOE["moe_intermediate_size"]
        names[f"blk.{i}.ffn_gate_inp.weight"] = (p + "mlp.gate.weight", (e, h))
        names[f"blk.{i}.ffn_gate_exps.weight"] = (p + "mlp.experts.gate_proj", (e, fe, h))
        names[f"blk.{i}.ffn_up_exps.weight"] = (p + "mlp.experts.up_proj", (e, fe, h))
        names[f"blk.{i}.ffn_down_exps.weight"] = (p + "mlp.experts.down_proj", (e, h, fe))
        return names
    for x, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
        names[f"blk.{i}.ffn_{x}.weight"] = (p + f"mlp.{x}_proj.weight", shape)
    if arch == "gemma3":
        names[f"blk.{i}.post_attention_norm.weight"] = names.pop(f"blk.{i}.ffn_norm.weight")
        names[f"blk.{i}.ffn_norm.weight"] = (p + "pre_feedforward_layernorm.weight", (h,))
        names[f"blk.{i}.post_ffw_norm.weight"] = (p + "post_feedforward_layernorm.weight", (h,))
    return names


def gguf_names(arch: str, num_layers: int) -> set[str]:
    """Every tensor name gguf-py's tables allow for `arch` (constants.py MODEL_TENSORS, TENSOR_NAMES)."""
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    return {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[model_arch]
            for i in range(num_layers) for suffix in (".weight", ".bias")}


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> dict:
    """SmolLM2's tokenizer metadata (tokens, merges, types, special ids, chat template). Read with
    transformers' GGUF reader: GGUFReader takes seconds over 49k tokens and 49k merges."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from model_files.prepare import default_gguf_path

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    metadata, _ = read_gguf_metadata(str(default_gguf_path()), keys)
    return dict(tokens=metadata[keys[0]], merges=metadata[keys[1]], token_types=metadata[keys[2]],
                chat_template=metadata["tokenizer.chat_template"],
                bos=1, eos=2, unk=0, pad=2)  # SmolLM2's ids, as its GGUF has them


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rows -> GGUF rows, per head."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encode(rng: np.random.Generator, shape: tuple[int, ...], qtype: T) -> np.ndarray:
    """Bytes (or values, F32 / F16) of a random tensor of torch shape `shape` ([rows, cols] or
    [E, rows, cols]) in `qtype`."""
    if len(shape) == 3:
        return encode(rng, (shape[0] * shape[1], shape[2]), qtype).reshape(*shape[:2], -1)
    if qtype in F16_SCALES:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
        for offset, scale in F16_SCALES[qtype].items():
            d = (scale * rng.uniform(0.5, 1.5, blocks.shape[:2])).astype(np.float16)
            blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
        return blocks.reshape(rows, -1)
    values = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    return quantize(values, qtype)


def write_tiny_gguf(path: Path, arch: str, types: dict[str, T], seed: int = 0, tied: bool = True, head_dim: int = 64,
                    rope_freqs: np.ndarray | None = None, gguf_arch: str | None = None,
                    vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Writes a tiny `arch` GGUF to `path`; returns its reference weights (transformers name -> float32).

    types: tensor kind ("attn_q", "ffn_down", "ffn_gate_exps", "token_embd", "output", ...) -> its type; norms,
    biases and kinds not named are F32. tied: no output.weight. head_dim: qwen3's / gemma3's may differ from
    hidden / heads. rope_freqs: written as llama3 rope's tensor.
    gguf_arch: the general.architecture to claim instead of `arch` (unsupported-architecture tests).
    vocab_size: no tokenizer, and that many embedding rows (files refused before the tokenizer matters)."""
    c = sizes(arch, head_dim)
    tok = smollm2_tokenizer() if vocab_size is None else None
    vocab = len(tok["tokens"]) if tok else vocab_size
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), gguf_arch or arch)
    add_hparams(writer, arch, c, vocab)
    if tok:
        add_tokenizer(writer, tok, PRE_TOKENIZER[arch])
    h = c["hidden_size"]
    tensors = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, h)),
               "output_norm.weight": ("model.norm.weight", (h,))}
    if not tied:
        tensors["output.weight"] = ("lm_head.weight", (vocab, h))
    for i in range(c["num_hidden_layers"]):
        tensors.update(layer_tensors(arch, i, c))
    assert gguf_arch or set(tensors) <= gguf_names(arch, c["num_hidden_layers"]), "not llama.cpp's names"
    reference = {}
    for gguf_name, (hf_name, shape) in tensors.items():
        kind = gguf_name.split(".")[-2]
        qtype = types.get(kind, T.F32) if len(shape) > 1 else T.F32
        data = encode(rng, shape, qtype)
        if len(shape) == 1:  # norms around 1, biases around 0
            data = data * 3 + (1.0 if "norm" in gguf_name else 0.0)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        weights = np.array(dequantize(data, qtype), dtype=np.float32).reshape(shape)  # GGUF row order
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = c["num_attention_heads"] if kind == "attn_q" else c["num_key_value_heads"]
            weights[permute(np.arange(shape[0]), heads)] = weights.copy()  # GGUF row j is HF row perm[j]
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            weights -= 1.0
        reference[hf_name] = weights
    for i in range(c["num_hidden_layers"] if arch == "qwen3moe" else 0):
        p = f"model.layers.{i}.mlp.experts."
        reference[p + "gate_up_proj"] = np.concatenate([reference.pop(p + "gate_proj"),
                                                        reference.pop(p + "up_proj")], axis=1)  # [E, 2I, H]
    add_rope_tensors(writer, arch, rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def add_rope_tensors(writer: GGUFWriter, arch: str, rope_freqs: np.ndarray | None) -> None:
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if arch == "phi3":  # Phi3MiniModel.generate_extra_tensors
        writer.add_tensor("rope_factors_long.weight", np.array(PHI3["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(PHI3["short_factor"], dtype=np.float32))


def add_tokenizer(writer: GGUFWriter, tok: dict, pre: str) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_unk_token_id(tok["unk"])
    writer.add_pad_token_id(tok["pad"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["chat_template"])


def add_hparams(writer: GGUFWriter, arch: str, c: dict, vocab: int) -> None:
    """The keys each converter class writes (convert_hf_to_gguf.py: TextModel, Gemma3Model, Phi3MiniModel,
    Qwen2MoeModel)."""
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(ROPE_THETA[arch])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    if arch != "phi3":  # Phi3MiniModel writes no key_length: its head is hidden / heads
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if arch in ("llama", "qwen2", "qwen3"):
        writer.add_rope_dimension_count(c["head_dim"])
    if arch == "gemma3":  # no sliding_window_pattern, no freq_base_swa: files from before llama.cpp wrote them
        writer.add_sliding_window(GEMMA3["sliding_window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(GEMMA3["rope_scaling_factor"])
    if arch == "phi3":
        original = PHI3["original_max_position_embeddings"]
        writer.add_rope_dimension_count(int(PHI3["partial_rotary_factor"] * c["hidden_size"]) // c["num_attention_heads"])
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(PHI3["sliding_window"])
        scale = c["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    if arch == "qwen3moe":
        writer.add_expert_count(QWEN3MOE["num_experts"])
        writer.add_expert_used_count(QWEN3MOE["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(QWEN3MOE["moe_intermediate_size"])
