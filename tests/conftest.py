"""Shared fixtures: the prepared SmolLM2 checkpoint and tiny random-weight models built from it.

Prepared models live in the user cache (TETHER_CACHE_DIR, else ~/.cache/tether),
so a second test run does not convert the GGUF again.
"""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors (tests/kernels/: paged attention, sampling). Set here,
    # before any test module imports triton: @triton.jit reads it when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from model_files.prepare import prepare_model

    return prepare_model("default", progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir, tmp_path_factory) -> Path:
    from testing.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(smollm2_dir, tmp_path_factory) -> Path:
    from testing.tiny_hybrid import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-hybrid"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_family(smollm2_dir, tmp_path_factory):
    """family -> the directory of its tiny random-weight checkpoint (testing/tiny_families.py), built once."""
    from testing.tiny_families import make_tiny_family, make_tiny_gemma3_multimodal

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = make_tiny_gemma3_multimodal(out, smollm2_dir) if family == "gemma3_multimodal" \
                else make_tiny_family(family, out, smollm2_dir)
        return made[family]

    return get
