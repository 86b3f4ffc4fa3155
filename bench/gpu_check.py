"""GPU check for the hybrid layers: kernel parity on CUDA, then timings. By hand on a CUDA machine, never in CI.

    bash bench/gpu_check.sh            (= python bench/gpu_check.py)

1. runs the kernel parity tests (tests/parity/test_gated_delta_rule.py, test_causal_conv1d.py): on CUDA
   their fla / Triton cases run against the PyTorch references instead of skipping;
2. times, for one linear-attention layer of Qwen3.5 shape (bf16 inputs), a 4k-token prefill
   (chunk_gated_delta_rule) and a 64-sequence decode step (fused_recurrent_gated_delta_rule), each with the
   PyTorch reference and with the dispatcher (fla where importable), and prints a table.
Without CUDA it says so and exits 0 (tests/unit/test_gpu_check.py imports it so it cannot rot).
"""

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARITY_TESTS = ["tests/parity/test_gated_delta_rule.py", "tests/parity/test_causal_conv1d.py"]


@dataclass
class Case:
    name: str
    num_seqs: int
    tokens_per_seq: int
    H: int = 16  # Qwen3.5-style linear attention: 16 key heads, 32 value heads, 128-dim heads
    HV: int = 32
    K: int = 128
    V: int = 128


CASES = [Case("prefill 4k tokens", 1, 4096), Case("decode 64 sequences", 64, 1)]


def inputs(case: Case, device: str, dtype=torch.bfloat16) -> dict:
    T = case.num_seqs * case.tokens_per_seq
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    cu_seqlens = torch.arange(0, T + 1, case.tokens_per_seq, dtype=torch.int64, device=device)
    return dict(q=rand(1, T, case.H, case.K), k=rand(1, T, case.H, case.K), v=rand(1, T, case.HV, case.V),
                g=-torch.rand(1, T, case.HV, generator=g).to(device=device, dtype=torch.float32),
                beta=torch.rand(1, T, case.HV, generator=g).to(device=device, dtype=dtype),
                initial_state=torch.zeros(case.num_seqs, case.HV, case.K, case.V, device=device),
                output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)


def time_ms(fn, repeats: int = 5) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def timings(device: str) -> list[tuple[str, float, float]]:
    from replicas.kernels.gated_delta_rule import (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                                   naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule)

    rows = []
    for case in CASES:
        args = inputs(case, device)
        if case.tokens_per_seq > 1:
            ref, fast = naive_chunk_gated_delta_rule, chunk_gated_delta_rule
        else:
            ref, fast = naive_recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule
        rows.append((case.name, time_ms(lambda: ref(**args)), time_ms(lambda: fast(**args))))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a CUDA machine)")
        return 0
    parity = subprocess.run([sys.executable, "-m", "pytest", "-q", *PARITY_TESTS], cwd=ROOT)
    print(f"{'layer op':24}{'reference ms':>14}{'kernel ms':>12}{'speed-up':>10}")
    for name, ref_ms, fast_ms in timings("cuda"):
        print(f"{name:24}{ref_ms:>14.2f}{fast_ms:>12.2f}{ref_ms / fast_ms:>10.1f}")
    return parity.returncode


if __name__ == "__main__":
    sys.exit(main())
