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
# engine.compile_step defaults to false here: compiling every engine the suite starts (dozens of models, each
# process anew) cost it ~200 s (14:37 instead of ~11:30). tests/engine/test_compiled_step.py turns it on.
os.environ.setdefault("TETHER_COMPILE_STEP", "0")
if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors (tests/kernels/: paged attention, sampling). Set here,
    # before any test module imports triton: @triton.jit reads it when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


_prebuilds = []


def pytest_sessionstart(session):
    """Every native op builds at once in two background processes (replicas/kernels/prebuild.py), instead of one
    after another as tests first need them: ~80 s less on a fresh 2-core machine; on a warm cache they only load."""
    from core.env import native_disabled
    from replicas.kernels.prebuild import start

    if not native_disabled():
        _prebuilds.extend(start(jobs=2))


def pytest_sessionfinish(session, exitstatus):
    for process in _prebuilds:
        process.wait()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from model_files.prepare import prepare_model

    return prepare_model("default", progress=False)


@pytest.fixture(scope="session")
def smollm2_float32_dir() -> Path:
    """The default model with its weights dequantized to float32 safetensors: what transformers loads."""
    from model_files.prepare import prepare_model

    return prepare_model("default", progress=False, float32=True)


@pytest.fixture(scope="session")
def alone_replies(smollm2_dir):
    """dtype name -> testing.invariance's six prompts, each alone on SmolLM2 (batch_invariant, the default): its
    64 greedy (token, logprob) pairs. The reference the batch-invariance tests compare against (engine, HTTP)."""
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine
    from testing.chat import chat_ids
    from testing.invariance import PROMPTS, greedy_replies

    made: dict[str, list] = {}

    def get(dtype: str) -> list:
        if dtype not in made:
            engine = Engine(EngineConfig(model=str(smollm2_dir), dtype=dtype, enable_prefix_caching=False))
            assert engine.model.batch_invariant, "batch_invariant is on by default where the native ops build"
            made[dtype] = [greedy_replies(engine, [chat_ids(engine.tokenizer, text)], 64)[0] for text in PROMPTS]
        return made[dtype]

    return get


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
