"""GPU check: kernel parity on CUDA, then kernel and decode-step timings. By hand on a CUDA machine, never in CI.

    bash bench/gpu/gpu_check.sh            (= python -m bench.gpu.gpu_check [--skip-engine])

1. runs the kernel parity tests (PARITY_TESTS): on CUDA their fla / Triton cases run compiled against the
   PyTorch references instead of skipping (or running under Triton's interpreter);
2. times, for one linear-attention layer of Qwen3.5 shape (bf16 inputs), a 4k-token prefill
   (chunk_gated_delta_rule) and a 64-sequence decode step (fused_recurrent_gated_delta_rule), each with the
   PyTorch reference and with the dispatcher (fla where importable);
3. times the paged decode attention kernel against the PyTorch group path it replaces on CUDA, at batch 1,
   16 and 64 of a ~1B Llama attention shape (H=32, Hkv=8, D=64, context 2048, block 16, bf16), with the
   KV bytes read per second against the device's peak (GPU_PEAK_GBPS, else a table by device name);
4. times the row-sampling kernel against its reference at 64 rows x 152k vocabulary (greedy, drawn);
5. times engine decode steps of a ~1B random-weight model of each family (Llama, the Qwen3.5 hybrid) at
   batch 1, 16 and 64, with the model's weight bytes over the step time (needs the default model's
   tokenizer; each checkpoint is first written to a temporary directory, in float32: ~4-5 GB each).
Steps 2-5 are testing/gpu_timings.py's (tests/unit/test_gpu_check.py runs each at tiny shapes on CPU, the
kernels under Triton's interpreter, so they cannot rot). Without CUDA it says so and exits 0.
"""

import argparse
import subprocess
import sys
import traceback

import torch

from bench.common import ROOT
from testing.gpu_timings import (attention_timings, engine_timings, peak_gbps, print_kernel_table, sampling_timings,
                                 timings)

PARITY_TESTS = ["tests/kernels/test_gated_delta_rule.py", "tests/kernels/test_causal_conv1d.py",
                "tests/kernels/test_paged_attention.py", "tests/kernels/test_sampling.py",
                "tests/kernels/test_triton_compile.py"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-engine", action="store_true", help="no engine decode-step timings (step 5)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a CUDA machine)")
        return 0
    parity = subprocess.run([sys.executable, "-m", "pytest", "-q", *PARITY_TESTS], cwd=ROOT)
    peak = peak_gbps()
    print(f"\n{torch.cuda.get_device_name()}: peak bandwidth {f'{peak:.0f} GB/s' if peak else 'unknown'}"
          " (set GPU_PEAK_GBPS to override)")
    print(f"{'layer op':24}{'reference ms':>14}{'kernel ms':>12}{'speed-up':>10}")
    for name, ref_ms, fast_ms in timings("cuda"):
        print(f"{name:24}{ref_ms:>14.2f}{fast_ms:>12.2f}{ref_ms / fast_ms:>10.1f}")
    print_kernel_table("paged decode attention (bf16)", attention_timings("cuda"), peak)
    print_kernel_table("row sampling (float32)", sampling_timings("cuda"), peak)
    if args.skip_engine:
        return parity.returncode
    try:
        rows = engine_timings("cuda")
    except Exception:
        traceback.print_exc()
        return 1
    print(f"\n{'engine decode step (bf16)':32}{'batch':>6}{'ms/step':>10}{'tok/s':>9}{'weight GB/s':>13}{'of peak':>9}")
    for name, batch, step_ms, gbps in rows:
        share = f"{gbps / peak:.0%}" if peak else "unknown"
        print(f"{name:32}{batch:>6}{step_ms:>10.2f}{batch / step_ms * 1e3:>9.0f}{gbps:>13.0f}{share:>9}")
    return parity.returncode


if __name__ == "__main__":
    sys.exit(main())
