"""SmolLM2's tokenizer dressed as another model family: that family's special tokens, BOS/EOS/PAD and its
published chat template (testing/data/chat_templates/<family>.jinja; SOURCES.md says where each came from).

The BPE underneath stays SmolLM2's, so ordinary text tokenizes as SmolLM2 does (its GPT-2 pre-tokenizer, not
the family's); what is the family's is every control token the template writes, one id each, and the template.
The tokens SmolLM2 lacks are appended after its 49,152, so a model built on such a tokenizer needs
vocab_size == len(tokenizer).
"""

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "data" / "chat_templates"

# family -> {
#   "bos", "eos", "pad": the tokenizer's (eos: the token the model ends a chat turn with),
#   "other_eos": the model's other stop tokens (its generation_config.json eos_token_id list; they belong there),
#   "special": every special (control) token the template writes,
#   "added": tokens the template writes that the model's vocabulary holds as single, non-special ids
#            (Qwen's <think>, <tool_call>: decoding with skip_special_tokens keeps them, as the real tokenizer does),
# }
FAMILY_TOKENS: dict[str, dict] = {
    "llama3": {  # meta-llama/Llama-3.1-8B-Instruct
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
        "other_eos": ["<|end_of_text|>", "<|eom_id|>"],
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                    "<|python_tag|>"],
        "added": [],
    },
    "qwen2": {  # Qwen/Qwen2.5-7B-Instruct
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
        "other_eos": ["<|endoftext|>"],
        "special": ["<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>"],
    },
    "qwen3": {  # Qwen/Qwen3-0.6B
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
        "other_eos": ["<|endoftext|>"],
        "special": ["<|im_start|>", "<|im_end|>"],
        "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    },
    "qwen3_5": {  # Qwen3.5-4B
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
        "other_eos": ["<|endoftext|>"],
        "special": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                    "<|video_pad|>"],
        "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    },
    "mistral": {  # mistralai/Mistral-Nemo-Instruct-2407 (the [INST] template of the v3 tokenizers)
        "bos": "<s>", "eos": "</s>", "pad": None,
        "other_eos": [],
        "special": ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        "added": [],
    },
    "gemma3": {  # google/gemma-3-4b-it
        "bos": "<bos>", "eos": "<end_of_turn>", "pad": "<pad>",
        "other_eos": ["<eos>"],
        "special": ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
        "added": [],
    },
    "phi3": {  # microsoft/Phi-3.5-mini-instruct; its tokenizer_config's eos_token is <|endoftext|>, which the
        # template writes after a conversation rendered without a generation prompt
        "bos": "<s>", "eos": "<|end|>", "pad": "<|endoftext|>",
        "other_eos": ["<|endoftext|>", "<|assistant|>"],
        "special": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
        "added": [],
    },
}


def family_special_tokens(family: str) -> list[str]:
    """Every special token the family's tokenizer holds beyond SmolLM2's: the template's, BOS/EOS/PAD, other EOS."""
    tokens = FAMILY_TOKENS[family]
    named = [tokens["bos"], tokens["eos"], tokens["pad"], *tokens["other_eos"]]
    return list(dict.fromkeys([*tokens["special"], *(t for t in named if t)]))


def make_family_tokenizer(family: str, base_dir: Path, out_dir: Path) -> Path:
    """Writes a tokenizer for `family` to out_dir (SmolLM2's BPE from base_dir + the family's tokens and template).

    Special tokens are registered as extra special tokens (never split, dropped by skip_special_tokens);
    "added" ones are single ids that decoding keeps. The model that uses it needs vocab_size == len(tokenizer).
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokens = FAMILY_TOKENS[family]
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    special = [AddedToken(t, special=True, normalized=False) for t in family_special_tokens(family)]
    # transformers 4.x calls the list additional_special_tokens; 5 extra_special_tokens
    is_v4 = "additional_special_tokens" in tokenizer.SPECIAL_TOKENS_ATTRIBUTES
    key = "additional_special_tokens" if is_v4 else "extra_special_tokens"
    tokenizer.add_special_tokens({key: special})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens["added"]])
    tokenizer.bos_token = tokens["bos"]
    tokenizer.eos_token = tokens["eos"]
    tokenizer.pad_token = tokens["pad"]
    tokenizer.chat_template = (TEMPLATE_DIR / f"{family}.jinja").read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
