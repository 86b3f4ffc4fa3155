"""The GPU check's measurements (testing/gpu_timings.py) stay runnable: their inputs build and each timing
path runs on CPU (tiny shapes; the Triton kernels under the interpreter). That its command, without CUDA, says
so and succeeds is tests/unit/test_bench_commands.py's."""

import pytest
import torch

from testing import gpu_timings


def test_inputs_and_timings_run_on_cpu_at_tiny_shapes(monkeypatch):
    tiny = [gpu_timings.Case("prefill", 1, 70, H=2, HV=4, K=8, V=8),
            gpu_timings.Case("decode", 3, 1, H=2, HV=4, K=8, V=8)]
    monkeypatch.setattr(gpu_timings, "CASES", tiny)
    args = gpu_timings.inputs(tiny[0], "cpu")
    assert args["q"].shape == (1, 70, 2, 8) and args["initial_state"].shape == (1, 4, 8, 8)
    rows = gpu_timings.timings("cpu")
    assert [r[0] for r in rows] == ["prefill", "decode"] and all(r[1] > 0 and r[2] > 0 for r in rows)


def test_kernel_timings_run_on_cpu_at_tiny_shapes(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(gpu_timings, "ATTENTION_CASES", [gpu_timings.AttentionCase(2, 40, H=4, HKV=2, D=16)])
    monkeypatch.setattr(gpu_timings, "SAMPLING_SHAPE", (3, 2000))
    monkeypatch.setattr(gpu_timings, "KERNEL_REPEATS", 1)
    args = gpu_timings.attention_inputs(gpu_timings.ATTENTION_CASES[0], "cpu")
    assert args["group"].mask.shape == (2, 1, 1, 40) and args["group"].block_tables.shape == (2, 3)
    rows = gpu_timings.attention_timings("cpu") + gpu_timings.sampling_timings("cpu")
    assert [r[0] for r in rows] == ["decode B=2 ctx=40", "sample 3x2000 greedy", "sample 3x2000 drawn"]
    assert all(r[1] > 0 and r[2] > 0 and r[3] > 0 for r in rows)
    gpu_timings.print_kernel_table("tiny", rows, gpu_timings.peak_gbps())


def test_engine_timings_run_on_cpu_with_tiny_models(monkeypatch, smollm2_dir):
    monkeypatch.setattr(gpu_timings, "ENGINE_MODELS", {"llama": ("llama", {}), "hybrid": ("qwen3_5", {})})
    monkeypatch.setattr(gpu_timings, "ENGINE_BATCHES", [1, 3])
    monkeypatch.setattr(gpu_timings, "PROMPT_LEN", 20)
    monkeypatch.setattr(gpu_timings, "DECODE_STEPS", 2)
    rows = gpu_timings.engine_timings("cpu", dtype="float32")
    assert [(r[0], r[1]) for r in rows] == [("llama", 1), ("llama", 3), ("hybrid", 1), ("hybrid", 3)]
    assert all(r[2] > 0 and r[3] > 0 for r in rows)


def test_peak_bandwidth_from_env(monkeypatch):
    monkeypatch.setenv("GPU_PEAK_GBPS", "1234")
    assert gpu_timings.peak_gbps() == 1234.0
    monkeypatch.delenv("GPU_PEAK_GBPS")
    if not torch.cuda.is_available():
        assert gpu_timings.peak_gbps() is None  # "unknown" in the tables


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
