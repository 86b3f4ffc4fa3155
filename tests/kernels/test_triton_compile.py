"""Every Triton kernel compiles for Hopper (sm_90), here and in CI, without a GPU.

The interpreter runs the Triton kernels' parity tests (test_paged_attention.py, test_sampling.py) on CPU but
checks less than the compiler (loop-carried types, tl.dot shapes and dtypes, constexpr branches), so this
compiles each kernel down to a cubin with Triton's own ptxas, at the shapes the models use. It runs in a
subprocess: tests/conftest.py turns the interpreter on for this process, and an interpreted kernel cannot be
compiled.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = dict(q="*{dt}", k_cache="*{dt}", v_cache="*{dt}", o="*{dt}", o_partial="*fp32", lse_partial="*fp32",
                 block_tables="*i32", context_lens="*i32", scale="fp32", N="i32", SPLIT_SIZE="i32")
# (H, HKV, D): Llama 3.2 1B, Qwen3.5's gated full attention (head_dim 256)
ATTENTION_SHAPES = [(32, 8, 64), (16, 2, 256)]


def compile_all() -> list[str]:
    """Compiles every kernel at the model shapes for sm_90; returns one line per kernel compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from replicas.kernels.paged_attention.triton_decode import (paged_decode_attention_kernel,
                                                                paged_decode_reduce_kernel)
    from replicas.kernels.paged_attention.triton_store import store_kvcache_kernel
    from replicas.kernels.sampling.triton_sample import BV, sample_rows_kernel, sample_rows_reduce_kernel

    done = []

    def build(kernel, types: dict, **constexprs):
        signature = {**types, **{name: "constexpr" for name in constexprs}}
        triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
        done.append(f"{kernel.fn.__name__} {types.get('q', '')} {constexprs}")

    for dt in ("bf16", "fp32"):
        for H, HKV, D in ATTENTION_SHAPES if dt == "bf16" else ATTENTION_SHAPES[:1]:  # fp32: tests only
            for num_splits in (1, 4):
                build(paged_decode_attention_kernel, {k: v.format(dt=dt) for k, v in ATTENTION.items()},
                      H=H, HKV=HKV, G=H // HKV, D=D, BS=16, BG=max(16, H // HKV), BD=D, BT=64, NUM_SPLITS=num_splits,
                      IS_INTERPRET=False, DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
        build(paged_decode_reduce_kernel, dict(o_partial="*fp32", lse_partial="*fp32", o=f"*{dt}"),
              H=32, D=64, NUM_SPLITS=5, BSPLIT=8, BD=64)
        build(store_kvcache_kernel, dict(k=f"*{dt}", v=f"*{dt}", k_cache=f"*{dt}", v_cache=f"*{dt}",
                                         slot_mapping="*i64", stride_k="i32", stride_v="i32"), HKVD=512, BKV=512)
    partials = dict(best_partial="*fp32", index_partial="*i32", m_partial="*fp32", s_partial="*fp32")
    build(sample_rows_kernel, dict(logits="*fp32", temperature="*fp32", noise="*fp32", **partials, V="i32",
                                   SPLIT_SIZE="i32"), NUM_SPLITS=8, BV=BV)
    build(sample_rows_reduce_kernel, dict(**partials, token_ids="*i64", lse="*fp32"), NUM_SPLITS=8, BSPLIT=8)
    return done


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns when unset)
    code = "from tests.kernels.test_triton_compile import compile_all; print(*compile_all(), sep='\\n')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.splitlines()) == 12, result.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
