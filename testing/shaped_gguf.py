"""Random-weight GGUFs with the shapes of real models (Llama-3.1-8B, Llama-3.2-1B), written tensor by tensor.

`write_gguf(path, shape, mixture)` writes F16 weights (normal, std 1 / sqrt(row length), so greedy text is not one
token repeated; bench/models/shaped_gguf.py quantizes them with llama.cpp's own llama-quantize), or the types
llama-quantize would give each tensor in a mixture (`mixture_type`) as random blocks with small float16 scales:
the real file size and types without llama.cpp, for loading and memory tests (tests/engine/test_gguf_kept.py).
Shapes (config values of the published models):
  llama-8b   Llama-3.1-8B: hidden 4096, 32 layers, 32 heads (8 KV) of 128, MLP 14336, vocab 128256
  llama-1b   Llama-3.2-1B: hidden 2048, 16 layers, 32 heads (8 KV) of 64, MLP 8192, vocab 128256, tied head
  llama-tiny hidden 256, 2 layers, SmolLM2's vocabulary (49152), tied head
The vocabulary is SmolLM2's (a real BPE tokenizer), filled up to the shape's size with tokens no text encodes to,
so the embedding and head have the real shapes.
"""

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T

from replicas.kernels.cpu_linear.gguf_blocks import BLOCKS
from testing.tiny_gguf import add_hparams, add_tokenizer, smollm2_tokenizer

SHAPES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     vocab=128256, tied=False),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     vocab=128256, tied=True),
    "llama-tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       vocab=49152, tied=True),
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape [rows, cols] (norms [n])."""
    h, f, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    shapes = {"token_embd.weight": (c["vocab"], h), "output_norm.weight": (h,)}
    if not c["tied"]:
        shapes["output.weight"] = (c["vocab"], h)
    for i in range(c["num_hidden_layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (q, h),
                       f"blk.{i}.attn_k.weight": (kv, h), f"blk.{i}.attn_v.weight": (kv, h),
                       f"blk.{i}.attn_output.weight": (h, q), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                       f"blk.{i}.ffn_down.weight": (h, f)})
    return shapes


def vocabulary(size: int) -> dict:
    """SmolLM2's tokenizer with filler tokens (normal, reachable by no merge) up to `size`."""
    tok = dict(smollm2_tokenizer())
    extra = size - len(tok["tokens"])
    tok["tokens"] = list(tok["tokens"]) + [f"<filler_{i}>" for i in range(extra)]
    tok["token_types"] = list(tok["token_types"]) + [1] * extra
    return tok


def mixture_type(mixture: str, name: str, num_layers: int, tied: bool) -> T:
    """The type llama.cpp's llama-quantize gives tensor `name` in a `mixture` file (llama-quant.cpp, for llama
    models: the head Q6_K, or the embedding where it is the tied head; in the _M mixtures, attn_v and ffn_down
    Q6_K in the first and last eighth of the layers and every third between); "F16": F16 matrices."""
    if mixture == "F16":
        return T.F16
    base = {"Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K}.get(mixture) or T[mixture]
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    if head and mixture in ("Q4_K_M", "Q5_K_M", "Q6_K"):
        return T.Q6_K
    if mixture.endswith("_M") and (".attn_v." in name or ".ffn_down." in name):
        i, eighth = int(name.split(".")[1]), num_layers // 8
        if i < eighth or i >= num_layers - eighth or (i - eighth) % 3 == 2:
            return T.Q6_K
    return base


def write_gguf(path: Path, shape: str, mixture: str = "F16", num_layers: int | None = None, seed: int = 0) -> None:
    """The shape's random-weight model (the first `num_layers` layers), written tensor by tensor; norms F32.
    F16: normal weights of std 1 / sqrt(row length), the head's HEAD_SCALE times that. A quantized `mixture` (mixture_type's types, without
    llama-quantize): random blocks, their float16 scales set to small values -- files of the real size and
    types, for loading and memory tests, whose weights are noise."""
    c = dict(SHAPES[shape])
    c["num_hidden_layers"] = num_layers or c["num_hidden_layers"]
    shapes = tensor_shapes(c)
    types = {name: mixture_type(mixture, name, c["num_hidden_layers"], c["tied"]) if len(dims) == 2 else T.F32
             for name, dims in shapes.items()}
    writer = GGUFWriter(str(path), "llama")
    add_hparams(writer, "llama", {k: v for k, v in c.items() if k not in ("vocab", "tied")}, c["vocab"])
    add_tokenizer(writer, vocabulary(c["vocab"]), "smollm")
    for name, dims in shapes.items():
        qtype = types[name]
        if qtype in (T.F16, T.F32):
            writer.add_tensor_info(name, dims, STORED[qtype], int(np.prod(dims)) * STORED[qtype].itemsize)
            continue
        qk, nbytes = GGML_QUANT_SIZES[qtype]
        stored = (*dims[:-1], dims[-1] // qk * nbytes)
        writer.add_tensor_info(name, stored, STORED[qtype], int(np.prod(stored)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    head = "token_embd.weight" if c["tied"] else "output.weight"
    for name, dims in shapes.items():
        writer.write_tensor_data(random_tensor(rng, dims, types[name], HEAD_SCALE if name == head else 1.0))
    writer.close()


STORED = {T.F32: np.dtype(np.float32), T.F16: np.dtype(np.float16)}
STORED = {t: STORED.get(t, np.dtype(np.uint8)) for t in (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                                                        T.Q4_K, T.Q5_K, T.Q6_K)}


# The head's F16 weights are this much larger: logits of std ~8, so the top token leads by nats, as a trained
# model's often does, rather than by the hundredths of a nat of 128k near-equal draws (where any rounding, such
# as llama.cpp's 8-bit activations, picks another token).
HEAD_SCALE = 8.0


def random_tensor(rng: np.random.Generator, dims: tuple[int, ...], qtype: T, scale: float = 1.0) -> np.ndarray:
    if qtype == T.F32:
        return np.ones(dims, dtype=np.float32)
    values = np.empty(dims, dtype=np.float16) if qtype == T.F16 else None
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = None if values is not None else np.empty((dims[0], dims[1] // qk, nbytes), dtype=np.uint8)
    for r in range(0, dims[0], 4096):  # 4096 rows at a time: bounded temporaries
        rows = min(4096, dims[0] - r)
        if values is not None:
            values[r:r + rows] = rng.standard_normal((rows, dims[1]), dtype=np.float32) * (scale / np.sqrt(dims[1]))
            continue
        chunk = rng.integers(0, 256, (rows, dims[1] // qk, nbytes), dtype=np.uint8)
        for at, size, unit in BLOCKS[qtype][2]:
            if unit == 2:  # d, m, dmin: float16 around 1e-4
                halves = (rng.uniform(0.5, 1.5, chunk.shape[:2]) * 1e-4).astype(np.float16)
                chunk[..., at:at + 2] = halves.view(np.uint8).reshape(*halves.shape, 2)
        blocks[r:r + rows] = chunk
    return values if values is not None else blocks.reshape(dims[0], -1)


