"""Which checkpoint architectures Tether serves, and what to tell a user whose model is not one of them.

Torch-free on purpose: the app builder (serve_app/app.py, in the `serve run` driver) checks a model
directory here before anything is deployed, and the loader checks the same table on the replica, so
an unsupported model fails with the same message wherever it is caught first.

Contract: `check_architecture` returns the `architectures` value the loader builds, or raises
`UnsupportedModelError` (a ValueError) whose message names the architecture, every supported one
with its family, and, where one is honestly close, the closest supported family and why.
"""

import json
from pathlib import Path

# config.json `architectures` value -> model family (one file per family under replicas/models/).
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",  # text-only checkpoints (model_type qwen3_5_text)
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # with its vision tower: images in chat
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
}

# A config.json without `architectures` (some GGUF conversions) loads as Llama, as it always has.
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"

_NO_IMAGES = "images are not supported yet"

# Unsupported architectures users bring -> (the closest supported architecture, why). Only where the
# hint helps: the same family's other generation or its text model; never a claim that it loads.
CLOSEST: dict[str, str] = {
    "GemmaForCausalLM": "Gemma3ForCausalLM",
    "Gemma2ForCausalLM": "Gemma3ForCausalLM",
    "MinistralForCausalLM": "MistralForCausalLM",
    "MixtralForCausalLM": "MistralForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "MllamaForConditionalGeneration": "LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen3MoeForCausalLM",
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "PhiForCausalLM": "Phi3ForCausalLM",
    "Phi3SmallForCausalLM": "Phi3ForCausalLM",
    "Phi3VForCausalLM": "Phi3ForCausalLM",
    "PhiMoEForCausalLM": "Phi3ForCausalLM",
    "PhimoeForCausalLM": "Phi3ForCausalLM",
    "Phi4MMForCausalLM": "Phi3ForCausalLM",
    "Phi4MultimodalForCausalLM": "Phi3ForCausalLM",
}

CLOSEST_WHY: dict[str, str] = {
    "GemmaForCausalLM": "an earlier Gemma generation; its checkpoints do not load as Gemma 3",
    "Gemma2ForCausalLM": "Gemma 2 soft-caps attention and logits and has no QK-norm; its checkpoints do not "
                         "load as Gemma 3",
    "MinistralForCausalLM": "Mistral with interleaved sliding-window layers",
    "MixtralForCausalLM": "Mistral with mixture-of-experts feed-forward layers; dense Mistral checkpoints load",
    "Mistral3ForConditionalGeneration": f"its text model is Mistral; {_NO_IMAGES}",
    "MllamaForConditionalGeneration": f"Llama 3.2 Vision adds cross-attention layers; {_NO_IMAGES}; the "
                                      "text-only Llama 3.2 checkpoints load",
    "Qwen2MoeForCausalLM": "Qwen2-MoE adds shared experts that Qwen3-MoE does not have",
    "Qwen2VLForConditionalGeneration": f"its text model is Qwen2; {_NO_IMAGES}",
    "Qwen2_5_VLForConditionalGeneration": f"its text model is Qwen2; {_NO_IMAGES}",
    "Qwen3VLForConditionalGeneration": f"its text model is Qwen3; {_NO_IMAGES}",
    "Qwen3VLMoeForConditionalGeneration": f"its text model is Qwen3-MoE; {_NO_IMAGES}",
    "Qwen3NextForCausalLM": "the hybrid Gated DeltaNet + attention MoE that Qwen3.5 grew from; its checkpoints "
                            "do not load as Qwen3.5",
    "Qwen3_5MoeForConditionalGeneration": "the MoE sibling with a vision tower: its images are not supported "
                                          "yet; a text-only checkpoint loads, and Qwen3_5ForConditionalGeneration "
                                          "(dense) takes images",
    "PhiForCausalLM": "Phi-1 and Phi-2 use a different layer layout; Phi-3 and Phi-4-mini checkpoints load",
    "Phi3SmallForCausalLM": "Phi-3-small uses block-sparse attention; Phi-3-mini and -medium load",
    "Phi3VForCausalLM": f"its text model is Phi-3; {_NO_IMAGES}",
    "PhiMoEForCausalLM": "Phi-3.5-MoE; its dense sibling Phi-3.5-mini loads",
    "PhimoeForCausalLM": "Phi-3.5-MoE; its dense sibling Phi-3.5-mini loads",
    "Phi4MMForCausalLM": f"its text model is Phi-4-mini (Phi3ForCausalLM); {_NO_IMAGES}, nor is audio",
    "Phi4MultimodalForCausalLM": f"its text model is Phi-4-mini (Phi3ForCausalLM); {_NO_IMAGES}, nor is audio",
}


class UnsupportedModelError(ValueError):
    """A model whose architecture Tether cannot build: a configuration error, never worth a retry."""


def supported_architectures() -> list[str]:
    return sorted(SUPPORTED)


def check_architecture(architectures: list[str] | None) -> str:
    """The first supported entry of a config.json `architectures` list (absent or empty: Llama).
    Raises UnsupportedModelError naming the first entry when none is supported."""
    if not architectures:
        return DEFAULT_ARCHITECTURE
    for arch in architectures:
        if arch in SUPPORTED:
            return arch
    raise UnsupportedModelError(unsupported_message(architectures[0]))


def unsupported_message(arch: str) -> str:
    supported = ", ".join(f"{name} ({SUPPORTED[name]})" for name in supported_architectures())
    message = f"architecture {arch!r} is not supported. Supported: {supported}."
    closest = CLOSEST.get(arch)
    if closest is not None:
        message += f" Closest supported family: {SUPPORTED[closest]} ({closest}: {CLOSEST_WHY[arch]})."
    return message


def check_model_dir(model_dir: str | Path) -> str:
    """`check_architecture` on a checkpoint directory's config.json, read as plain JSON (no transformers)."""
    path = Path(model_dir) / "config.json"
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return check_architecture(config.get("architectures"))
