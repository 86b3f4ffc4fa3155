"""SmolLM2 as Tether reads its GGUF -- the engine on its kept blocks, and its float32 conversion -- against
transformers' own reading of the GGUF.

Reference: transformers' GGUF loader. `from_pretrained(..., gguf_file=...)`
needs accelerate, which Tether does not depend on, so we call the function
from_pretrained uses for a GGUF (load_gguf_checkpoint: its own metadata
mapping, dequantization, Q/K un-permutation and names) and load its tensors
into a fresh model. One call yields both its config and its tensors.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from model_files.prepare import default_gguf_path

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(smollm2_float32_dir):
    """The default model converted to float32 (the session's, in the user cache)."""
    return smollm2_float32_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def input_ids(tokenizer) -> torch.Tensor:
    # input_ids: [1, T]
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([ids["input_ids"]])


@pytest.fixture(scope="module")
def reference(model) -> tuple[torch.nn.Module, dict]:
    """(SmolLM2 with transformers' GGUF tensors, transformers' GGUF config dict)."""
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(default_gguf_path()), return_tensors=True, model_to_load=reference)
    missing, unexpected = reference.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    reference.tie_weights()
    return reference.eval(), parsed["config"]


def test_logits_match_transformers_gguf_loader(model, reference, input_ids):
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, T, vocab]
        expected = reference[0](input_ids).logits  # [1, T, vocab]
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4


def test_kept_blocks_match_transformers_gguf_loader(smollm2_dir, reference, input_ids):
    """The engine on the GGUF's own blocks (model.gguf, gguf_blocks.py) against transformers' reading of it: float32
    sums in the engine's fixed order, not MKL's, through 30 layers, so within 1e-5 of the largest logit (~28)."""
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine
    from tests.parity.test_llama_parity import our_logits

    engine = Engine(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=16))
    with torch.no_grad():
        expected = reference[0](input_ids).logits[0]  # [T, vocab]
    assert (our_logits(engine, input_ids[0].tolist()) - expected).abs().max().item() <= 1e-5 * expected.abs().max()


def test_config_matches_transformers_gguf_config(model, reference):
    config, expected = model.config, reference[1]
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ):  # fmt: skip
        assert getattr(config, key) == expected[key], key
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}  # 5.x | 4.x
    assert rope["rope_theta"] == expected["rope_theta"]
    assert config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_chat_template_renders_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_greedy_generation_answers_paris(model, tokenizer, input_ids):
    with torch.no_grad():
        output_ids = model.generate(input_ids, max_new_tokens=8, do_sample=False)  # [1, T + 8]
    text = tokenizer.decode(output_ids[0, input_ids.shape[1] :])
    assert "Paris" in text, text


if __name__ == "__main__": import sys, pytest; sys.exit(pytest.main([__file__, "-q"]))
