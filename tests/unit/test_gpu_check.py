"""bench/gpu_check.py stays importable and runnable: its inputs build, its timing path runs on CPU (tiny
shapes), and without CUDA its entry point says so and succeeds."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inputs_and_timings_run_on_cpu_at_tiny_shapes(gpu_check, monkeypatch):
    tiny = [gpu_check.Case("prefill", 1, 70, H=2, HV=4, K=8, V=8), gpu_check.Case("decode", 3, 1, H=2, HV=4, K=8, V=8)]
    monkeypatch.setattr(gpu_check, "CASES", tiny)
    args = gpu_check.inputs(tiny[0], "cpu")
    assert args["q"].shape == (1, 70, 2, 8) and args["initial_state"].shape == (1, 4, 8, 8)
    rows = gpu_check.timings("cpu")
    assert [r[0] for r in rows] == ["prefill", "decode"] and all(r[1] > 0 and r[2] > 0 for r in rows)


def test_main_without_cuda_succeeds(gpu_check, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA here: main() would run the real check")
    assert gpu_check.main() == 0
    assert "no CUDA" in capsys.readouterr().out


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
