"""Tiny GGUF files of each supported architecture, in every supported tensor type (testing/tiny_gguf.py).

1. Each file, converted by prepare_model and loaded by our loader (load_model, float32, CPU), gives logits
   within 1e-4 of transformers' model holding the dequantized weights of the same bytes, with llama.cpp's
   changes undone by the test's own code: llama's Q/K rows un-permuted, gemma3's norms less 1, qwen3moe's
   stacked experts fused as transformers holds them. One llama file carries llama3 rope scaling baked into
   `rope_freqs`; gemma3 has 5 sliding layers around a global one with linear rope scaling, and a key_length
   that is not hidden / heads; phi3 has fused q|k|v and gate|up, partial rotary, LongRoPE factor tensors and
   a window; qwen3moe K-quant expert stacks.
2. The config, tokenizer files and generation config carry the architecture, head_dim, tied head, rope,
   special ids and chat template, and each family's own keys (layer types, experts, windows); qwen files get
   transformers' qwen2 split (`tokenizer.ggml.pre`).
3. An unsupported tensor type or architecture is refused by name, before anything is written.
4. llama3 rope_freqs: Meta's parameters and other ones are recovered exactly; arbitrary divisors refused;
   linear / yarn scaling keys map to HF's, others are refused.
5. Metadata alone (read_config): gemma3's sliding pattern as a count or per layer, its local rope base and the
   27B's attention scale; phi3's non-default attention factor, incomplete LongRoPE refused; qwen3moe's expert
   sizes; experts in a dense architecture refused.
"""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from core.engine_config import EngineConfig
from model_files.gguf import convert_gguf
from model_files.gguf_config import read_config
from model_files.gguf_rope import llama3_parameters, rope_parameters
from model_files.prepare import prepare_model
from replicas.kernels.cpu_linear.gguf_blocks import GGUFLinear, native_gguf
from replicas.engine.engine import Engine
from testing.tiny_gguf import GEMMA3, PHI3, QWEN3MOE, ROPE_THETA, T, sizes, smollm2_tokenizer, write_tiny_gguf
from tests.parity.test_llama_parity import our_logits

TOL = 1e-4
# What a Q4_K_M file mixes, and the 32-block types with F16 / BF16 around them.
K_QUANTS = dict(token_embd=T.Q4_K, output=T.Q6_K, attn_q=T.Q4_K, attn_k=T.Q4_K, attn_v=T.Q6_K,
                attn_output=T.Q5_K, ffn_gate=T.Q4_K, ffn_up=T.Q5_K, ffn_down=T.Q6_K)
LEGACY = dict(token_embd=T.Q8_0, output=T.F16, attn_q=T.Q4_0, attn_k=T.Q4_1, attn_v=T.Q5_0, attn_output=T.Q5_1,
              ffn_gate=T.F16, ffn_up=T.BF16, ffn_down=T.Q8_0)
MIXED = dict(token_embd=T.Q8_0, output=T.Q6_K, attn_q=T.Q4_K, attn_k=T.Q4_0, attn_v=T.Q4_1, attn_output=T.F16,
             ffn_gate=T.Q5_K, ffn_up=T.BF16, ffn_down=T.Q5_0)
MIXED_QWEN3 = dict(token_embd=T.Q6_K, attn_q=T.Q8_0, attn_k=T.Q4_K, attn_v=T.Q5_1, attn_output=T.Q5_K,
                   ffn_gate=T.Q4_0, ffn_up=T.F16, ffn_down=T.Q6_K)
# K-quant rows of 512 (gemma3's 4 heads of 128), expert stacks in K-quants (dequantized one expert at a time)
MIXED_GEMMA3 = dict(token_embd=T.Q8_0, attn_q=T.Q4_K, attn_k=T.Q8_0, attn_v=T.Q6_K, attn_output=T.Q5_K,
                    ffn_gate=T.Q4_0, ffn_up=T.F16, ffn_down=T.Q6_K)
MIXED_PHI3 = dict(token_embd=T.Q8_0, output=T.Q6_K, attn_qkv=T.Q4_K, attn_output=T.Q5_1, ffn_up=T.Q5_K,
                  ffn_down=T.Q8_0)
MIXED_QWEN3MOE = dict(token_embd=T.Q6_K, output=T.Q8_0, attn_q=T.Q8_0, attn_k=T.Q4_K, attn_v=T.Q5_0,
                      attn_output=T.Q6_K, ffn_gate_exps=T.Q4_K, ffn_up_exps=T.Q5_K, ffn_down_exps=T.Q8_0)
LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
# case -> (arch, types, tied head, head_dim, llama3 rope parameters)
CASES = {
    "llama-kquants": ("llama", K_QUANTS, False, 64, None),
    "llama-legacy-llama3rope": ("llama", LEGACY, True, 64, LLAMA3_ROPE),
    "qwen2-mixed": ("qwen2", MIXED, False, 64, None),
    "qwen3-mixed-headdim128": ("qwen3", MIXED_QWEN3, True, 128, None),
    "gemma3-mixed-headdim128": ("gemma3", MIXED_GEMMA3, True, 128, None),
    "phi3-longrope-partial": ("phi3", MIXED_PHI3, False, 64, None),
    "qwen3moe-mixed": ("qwen3moe", MIXED_QWEN3MOE, False, 64, None),
}
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM")}
# Config keys of each family's own, compared with the reference's
FAMILY_KEYS = {"gemma3": ("layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
                          "final_logit_softcapping"),
               "phi3": ("sliding_window", "original_max_position_embeddings"),
               "qwen3moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "decoder_sparse_step", "mlp_only_layers")}
PROMPT = [(17 * i + 5) % 49152 for i in range(37)]


def llamacpp_rope_freqs(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, as written there: [head_dim / 2] float32."""
    old = original_max_position_embeddings
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high_freq_factor:
            factors.append(1)
        elif wavelen > old / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def family_settings(arch: str, head_dim: int, rope: dict | None) -> dict:
    """The HF config keys of the tiny model, from testing/tiny_gguf.py's HF-side values."""
    if arch == "gemma3":
        num_layers = GEMMA3["num_hidden_layers"]
        return dict(head_dim=head_dim, sliding_window=GEMMA3["sliding_window"], query_pre_attn_scalar=head_dim,
                    layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
                    rope_parameters={"full_attention": dict(rope_type="linear", factor=GEMMA3["rope_scaling_factor"],
                                                            rope_theta=ROPE_THETA[arch]),
                                     "sliding_attention": dict(rope_type="default",
                                                               rope_theta=GEMMA3["local_rope_theta"])},
                    hidden_activation="gelu_pytorch_tanh")
    if arch == "phi3":
        longrope = {k: PHI3[k] for k in ("partial_rotary_factor", "original_max_position_embeddings", "short_factor",
                                          "long_factor")}
        return dict(sliding_window=PHI3["sliding_window"], rope_parameters=dict(
            rope_type="longrope", rope_theta=ROPE_THETA[arch], **longrope),
            original_max_position_embeddings=PHI3["original_max_position_embeddings"])
    settings = dict(rope_parameters={"rope_type": "llama3" if rope else "default", "rope_theta": ROPE_THETA[arch],
                                     **(rope or {})}, **({} if arch == "qwen2" else {"head_dim": head_dim}))
    return settings | (dict(QWEN3MOE, norm_topk_prob=True) if arch == "qwen3moe" else {})


def reference_model(arch: str, tied: bool, head_dim: int, rope: dict | None, weights: dict[str, np.ndarray]):
    """transformers' model of the tiny sizes, holding `weights` (the dequantized GGUF bytes)."""
    import transformers

    config_name, model_name = HF_CLASSES[arch]
    tiny = {k: v for k, v in sizes(arch, head_dim).items() if k != "head_dim"}
    config = getattr(transformers, config_name)(
        **tiny, vocab_size=len(smollm2_tokenizer()["tokens"]), tie_word_embeddings=tied, pad_token_id=2,
        **family_settings(arch, head_dim, rope))
    model = getattr(transformers, model_name)(config).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) == ({"lm_head.weight"} if tied else set())
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(case name, converted directory, reference model)."""
    arch, types, tied, head_dim, rope = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    rope_freqs = None if rope is None else llamacpp_rope_freqs(ROPE_THETA[arch], head_dim, **rope)
    path = tmp / f"{request.param}.gguf"
    weights = write_tiny_gguf(path, arch, types, seed=len(request.param), tied=tied, head_dim=head_dim,
                              rope_freqs=rope_freqs)
    model_dir = prepare_model(str(path), cache_dir=tmp / "cache", progress=False)
    return request.param, model_dir, reference_model(arch, tied, head_dim, rope, weights)


@pytest.mark.parametrize("native", [False, True], ids=["dequantized", "blocks"])
def test_logits_match_dequantized_reference(case, native):
    """The weights as the file holds them: dequantized to float32 at load (no native op), and kept in their
    blocks on the native kernels (gguf_gemm.cpp), with the engine's other native ops."""
    _, model_dir, reference = case
    if native and native_gguf() is None:
        pytest.skip("the GGUF block kernel is not built here")
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", pack_weights=False, native_kernels=native,
                                 int4_decode=False, num_kv_blocks=16))  # load_model(dir, float32, cpu)
    kept = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]
    assert kept and all((p.packed is not None) == native for m in kept for p in m.parts.values())
    got = our_logits(engine, PROMPT)  # [T, vocab]
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]  # [T, vocab]
    assert expected.abs().max() > 0.1  # not a degenerate model
    assert (got - expected).abs().max().item() <= TOL


def test_config_carries_architecture_and_rope(case):
    name, model_dir, reference = case
    arch, _, tied, head_dim, rope = CASES[name]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[arch][1]]
    assert config.get("head_dim", head_dim) == head_dim
    assert config["tie_word_embeddings"] is tied
    assert config["rope_parameters"] == reference.config.rope_parameters
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    loaded = AutoConfig.from_pretrained(str(model_dir))  # attribute names: Qwen3-MoE saves num_local_experts
    for key in FAMILY_KEYS.get(arch, ()):
        assert getattr(loaded, key) == getattr(reference.config, key), key


def test_tokenizer_and_generation_config(case):
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    name, model_dir, _ = case
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == smollm2_tokenizer()["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == \
           ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    split = json.loads((model_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    splits = [p["pattern"]["Regex"] for p in split.get("pretokenizers", []) if p["type"] == "Split"]
    assert splits == ([PRETOKENIZE_REGEX] if CASES[name][0].startswith("qwen") else [])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi 12345!"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2 and tokenizer.decode(ids) == text


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ2_XS], ids=lambda q: q.name)
def test_unsupported_tensor_type_is_refused(tmp_path, qtype):
    write_tiny_gguf(tmp_path / "x.gguf", "llama", dict(ffn_up=qtype), vocab_size=256)
    with pytest.raises(ValueError, match=rf"tensor blk\.0\.ffn_up\.weight has type {qtype.name}; supported: F32, "):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", "llama", {}, gguf_arch="gemma2", vocab_size=256)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma2'; supported: \['gemma3', 'llama', "
                                         r"'phi3', 'qwen2', 'qwen3', 'qwen3moe'\]"):
        prepare_model(str(tmp_path / "x.gguf"), cache_dir=tmp_path / "cache", progress=False)
    assert [p for p in (tmp_path / "cache" / "models").iterdir() if p.suffix != ".lock"] == []


def test_llama3_rope_freqs_recovered_exactly():
    freqs = llamacpp_rope_freqs(500000.0, 128, **LLAMA3_ROPE)  # Llama 3.1 8B's
    assert llama3_parameters(freqs, 500000.0, 128) == {"rope_type": "llama3", **LLAMA3_ROPE}


def test_llama3_rope_freqs_with_another_band_recovered():
    params = dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=8192)
    got = llama3_parameters(llamacpp_rope_freqs(500000.0, 128, **params), 500000.0, 128)
    assert got.keys() == {"rope_type", *params}
    assert got["rope_type"] == "llama3" and got["original_max_position_embeddings"] == 8192
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert got[key] == params[key], key


def test_arbitrary_rope_freqs_are_refused():
    freqs = np.linspace(1.0, 3.0, 64, dtype=np.float32) ** 2
    with pytest.raises(ValueError, match="recovered exactly; refusing"):
        llama3_parameters(freqs, 500000.0, 128)


@pytest.mark.parametrize("keys, expected", [
    ({}, {"rope_type": "default"}),
    ({"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 32768, "yarn_beta_fast": 32.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0}),
    ({"type": "longrope"}, ValueError),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 32768, "yarn_ext_factor": 0.5}, ValueError),
], ids=["none", "linear", "yarn", "longrope", "yarn-ext-factor"])
def test_rope_scaling_keys(keys, expected):
    metadata = {f"qwen2.rope.scaling.{k}": v for k, v in keys.items()} | {"qwen2.rope.freq_base": 1e6}
    field = lambda key, default=None: metadata.get(key, default)  # noqa: E731
    if expected is ValueError:
        with pytest.raises(ValueError, match="rope"):
            rope_parameters(field, "qwen2", 64, None)
    else:
        assert rope_parameters(field, "qwen2", 64, None) == {"rope_theta": 1e6, **expected}


def metadata_config(arch: str, keys: dict, **vectors: list[float]):
    """read_config over tiny sizes plus `keys` (metadata without the "{arch}." prefix); `vectors`: F32 tensors."""
    metadata = {"block_count": 6, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
                "attention.head_count_kv": 2, "context_length": 512, "attention.layer_norm_rms_epsilon": 1e-6, **keys}
    field = lambda key, default=None: metadata.get(key.removeprefix(f"{arch}."), default)  # noqa: E731
    tensors = {name: SimpleNamespace(data=np.array(v, np.float32), tensor_type=T.F32) for name, v in vectors.items()}
    return read_config(field, arch, {**tensors, "token_embd.weight": SimpleNamespace(shape=(256, 1000))})


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("keys, layer_types", [
    ({}, [F] * 6),
    ({"attention.sliding_window": 512}, [S] * 5 + [F]),
    ({"attention.sliding_window": 512, "attention.sliding_window_pattern": 3}, [S, S, F, S, S, F]),
    ({"attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False] * 3}, [S, F] * 3),
], ids=["no-window", "default-pattern-6", "pattern-3", "per-layer"])
def test_gemma3_layer_types(keys, layer_types):
    config = metadata_config("gemma3", {"attention.key_length": 128, **keys})
    assert config.layer_types == layer_types
    assert config.query_pre_attn_scalar == 128  # key_length, not hidden / heads


def test_gemma3_local_rope_base_and_27b_attention_scale():
    config = metadata_config("gemma3", {"block_count": 62, "attention.key_length": 128, "attention.sliding_window": 1024,
                                        "rope.freq_base": 1e6, "rope.freq_base_swa": 20000.0})
    assert config.query_pre_attn_scalar == 64  # llama.cpp's 27B (62 layers): hidden / heads
    assert config.rope_parameters == {F: {"rope_type": "default", "rope_theta": 1e6},
                                      S: {"rope_type": "default", "rope_theta": 20000.0}}


def test_gemma3_attention_softcapping_is_refused():
    with pytest.raises(ValueError, match="softcapping"):
        metadata_config("gemma3", {"attn_logit_softcapping": 50.0})


PHI3_KEYS = {"rope.dimension_count": 48, "rope.scaling.original_context_length": 128}
PHI3_FACTORS = {"rope_factors_long.weight": [4.0] * 24, "rope_factors_short.weight": [1.5] * 24}


@pytest.mark.parametrize("attn_factor, expected", [
    (None, None), (math.sqrt(1 + math.log(512 / 128) / math.log(128)), None), (1.5, 1.5),
], ids=["absent", "llama.cpp's-default", "other"])
def test_phi3_attention_factor_kept_when_not_default(attn_factor, expected):
    keys = PHI3_KEYS | ({} if attn_factor is None else {"rope.scaling.attn_factor": attn_factor})
    rope = metadata_config("phi3", keys, **PHI3_FACTORS).rope_parameters
    assert rope.get("attention_factor") == expected
    assert (rope["rope_type"], rope["partial_rotary_factor"], rope["long_factor"]) == ("longrope", 0.75, [4.0] * 24)


def test_phi3_without_factors_is_partial_default_rope_and_half_longrope_refused():
    rope = metadata_config("phi3", PHI3_KEYS).rope_parameters
    assert rope == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match="both rope_factors_long and rope_factors_short"):
        metadata_config("phi3", PHI3_KEYS, **{"rope_factors_long.weight": [4.0] * 24})


@pytest.mark.parametrize("size, expected", [(768, 768), ([768] * 6, 768), (None, 512 // 2), ([768, 512] * 3, None)],
                         ids=["one", "per-layer-equal", "absent", "per-layer-differing"])
def test_qwen3moe_expert_size(size, expected):
    keys = {"expert_count": 8, "expert_used_count": 2, "attention.key_length": 64}
    keys |= {} if size is None else {"expert_feed_forward_length": size}
    if expected is None:
        with pytest.raises(ValueError, match="expert_feed_forward_length differs per layer"):
            metadata_config("qwen3moe", keys)
        return
    config = metadata_config("qwen3moe", keys)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, expected)
    assert config.norm_topk_prob is True and config.mlp_only_layers == [] and config.decoder_sparse_step == 1


def test_experts_in_a_dense_architecture_are_refused():
    with pytest.raises(ValueError, match=r"mixture-of-experts GGUFs \(qwen3\.expert_count\)"):
        metadata_config("qwen3", {"expert_count": 8})


if __name__ == "__main__": import sys, pytest; sys.exit(pytest.main([__file__, "-q"]))
