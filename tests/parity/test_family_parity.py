"""Every supported family against its transformers implementation, on a tiny random-weight model with every
distinguishing feature on (testing/tiny_families.py), float32:

1. logits within 1e-4 of transformers' at every position of a 37-token prompt (longer than the sliding windows);
2. the same greedy tokens over 32 steps, our engine's way: three chat prompts batched together, through chunked
   prefill (a 16-token step budget), and again from a prefix-cache hit;
3. MoE families: each prompt alone gives the same tokens as batched.

The reference greedy is a loop of transformers' forward over its own KV cache, nothing of its generation
utilities (whose per-family input preparation is not the model).
"""

import pytest
import torch

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from replicas.device import has_fast_bf16
from replicas.engine.engine import Engine
from testing.tiny_families import FAMILIES
from tests.engine.conftest import run_all
from tests.parity.test_llama_parity import our_logits

TOL = 1e-4
NUM_STEPS = 32
MOE = ("qwen3_moe", "qwen3_5_moe")
CHATS = ["Write a short story about a lighthouse keeper who finds a message in a bottle one stormy night.",
         "Explain how a steam engine works, from the boiler to the wheels, for a curious ten year old.",
         "Tell me about the history of Paris, from the Roman settlement to the rebuilding under Haussmann."]


@pytest.fixture(scope="module")
def family_dir(request, tiny_family):
    return tiny_family(request.param)


def reference(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3ForConditionalGeneration

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    cls = Gemma3ForConditionalGeneration if config.architectures == ["Gemma3ForConditionalGeneration"] \
        else AutoModelForCausalLM
    return cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def reference_greedy(ref, ids: list[int], num_steps: int) -> list[int]:
    """Greedy decoding by transformers' forward and its own KV cache (no generation utilities)."""
    out, past, step_ids = [], None, ids
    with torch.inference_mode():
        for _ in range(num_steps):
            result = ref(torch.tensor([step_ids]), past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step_ids = out[-1:]
    return out


def chat_prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
            for text in CHATS]


def greedy(i: int, ids: list[int]) -> GenerateRequest:
    return GenerateRequest(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True))


ALL = [*FAMILIES, "gemma3_multimodal"]


@pytest.mark.parametrize("family_dir", ALL, indirect=True)
def test_logits_match_transformers(family_dir):
    engine = Engine(EngineConfig(model=str(family_dir), dtype="float32", block_size=4, num_kv_blocks=64))
    ref = reference(family_dir)
    vocab = engine.model_config.vocab_size
    prompt = [(17 * i + 5) % vocab for i in range(37)]  # 37: not a multiple of the block, past the windows
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0].float()
    got = our_logits(engine, prompt)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family_dir", ALL, indirect=True)
def test_greedy_matches_transformers_batched_chunked_and_cached(family_dir, request):
    # checkpoint_every: a hybrid model's prefix hit resumes from a recurrent-state checkpoint inside the prompt
    engine = Engine(EngineConfig(model=str(family_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                                 max_num_batched_tokens=16, checkpoint_every=8))
    ref = reference(family_dir)
    prompts = chat_prompts(engine)
    assert all(len(ids) > 16 for ids in prompts)  # each prompt takes more than one step: chunked
    expected = {f"p{i}": reference_greedy(ref, ids, NUM_STEPS) for i, ids in enumerate(prompts)}
    batched = run_all(engine, [greedy(i, ids) for i, ids in enumerate(prompts)])
    assert batched == expected
    cached_before = engine.stats.num_prompt_tokens_cached
    again = run_all(engine, [greedy(i, ids) for i, ids in enumerate(prompts)])  # prefix-cache hits now
    assert again == expected
    assert engine.stats.num_prompt_tokens_cached - cached_before >= sum(len(ids) - 4 for ids in prompts) // 2
    if request.node.callspec.params["family_dir"] in MOE:
        fresh = Engine(EngineConfig(model=str(family_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                                    enable_prefix_caching=False))
        alone = {}
        for i, ids in enumerate(prompts):
            alone |= run_all(fresh, [greedy(i, ids)])
        assert alone == batched


@pytest.mark.parametrize("family_dir", ["llama3", "gemma3"], indirect=True)
def test_every_stop_token_of_generation_config_ends_a_turn(family_dir, request):
    from testing.family_tokenizers import FAMILY_TOKENS

    engine = Engine(EngineConfig(model=str(family_dir), dtype="float32", num_kv_blocks=16))
    family = request.node.callspec.params["family_dir"]
    names = [FAMILY_TOKENS[family]["eos"], *FAMILY_TOKENS[family]["other_eos"]]
    assert len(names) >= 2
    assert set(engine.tokenizer.convert_tokens_to_ids(names)) <= engine.eos_token_ids


def test_the_loader_builds_every_architecture_the_refusal_names():
    from model_files.architectures import SUPPORTED
    from replicas.models.loader import ARCHITECTURES

    assert set(ARCHITECTURES) == set(SUPPORTED)


@pytest.mark.skipif(not has_fast_bf16(torch.device("cpu")), reason="bf16 tolerances hold where dtype auto picks bf16 "
                    "(AVX512-BF16 or AMX); the float32 tests above run everywhere")
@pytest.mark.parametrize("family_dir", ALL, indirect=True)
def test_bfloat16_stays_close_to_transformers_float32(family_dir):
    """The fast path of each family (bf16 weights and KV, packed linears, native ops): the logprob of
    transformers' float32 top token moves by at most 0.02 on average and 0.1 anywhere (measured: mean
    0.002-0.011, max 0.004-0.03), and the top token is the same at >= 90% of positions (near-ties aside)."""
    engine = Engine(EngineConfig(model=str(family_dir), dtype="bfloat16", block_size=4, num_kv_blocks=64))
    ref = reference(family_dir)
    prompt = [(17 * i + 5) % engine.model_config.vocab_size for i in range(37)]
    with torch.inference_mode():
        expected = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = torch.log_softmax(our_logits(engine, prompt), dim=-1)
    top = expected.argmax(dim=-1, keepdim=True)  # [L, 1]
    gaps = (got.gather(1, top) - expected.gather(1, top)).abs()
    assert gaps.mean().item() <= 0.02 and gaps.max().item() <= 0.1
    assert (got.argmax(dim=-1, keepdim=True) == top).float().mean().item() >= 0.9
