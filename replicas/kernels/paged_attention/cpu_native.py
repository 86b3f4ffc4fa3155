"""The native CPU paged-attention op (cpu_attention.cpp), built once per host by replicas/kernels/native_build.py.

One call serves a step's whole varlen batch, decode rows and prefill chunks of many sequences together,
straight from the block tables (no gather, no padding, no mask tensor); its spec is naive_varlen_attention:

    cpu_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
                        sliding_window=0, softcap=0.0, batch_invariant=False) -> out          q, out: [T, H, D]
    cpu_store_kvcache(k, v, k_cache, v_cache, slot_mapping)                                   k, v: [T, Hkv, D]

batch_invariant=True: each row's output bits depend on its query, its sequence's keys and values up to its
position, the window, scale and softcap alone: not on the other rows and sequences of the call, the chunk the
row arrives in, or the thread count (cpu_attention.cpp says how; it costs a few per cent of decode time).

native_ops() is None where the op cannot be built (see native_build); callers then keep the PyTorch path.
Once it said the op is there, the wrappers call torch.ops.tether.* directly, not through the cached getter,
so torch.compile traces them without a graph break.
"""

import functools
from pathlib import Path

import torch

from replicas.kernels.native_build import load_native, mutates_only

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


FAKES = {"paged_attention": mutates_only, "store_kvcache": mutates_only}


@functools.cache  # load_native resolves the source path on every call: ~10 us, per layer call
def native_ops():
    """torch.ops.tether (paged_attention, store_kvcache), or None. The first call on a host builds it."""
    return load_native("tether_paged_attention", [SOURCE], FAKES)


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, sliding_window: int = 0,
                        softcap: float = 0.0, batch_invariant: bool = False) -> torch.Tensor:
    # q: [T, H, D] float32 / bfloat16; k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype;
    # query_start_loc: [S + 1] int32; seq_lens: [S] int32, keys after this step (this step's already stored);
    # block_table: [S, max_blocks] int32 -> out: [T, H, D] in q's dtype
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.float32, torch.bfloat16), q.dtype
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.shape[2] == k_cache.shape[3] and q.shape[2] % 16 == 0 and q.shape[1] % k_cache.shape[2] == 0
    assert query_start_loc.dtype == seq_lens.dtype == block_table.dtype == torch.int32
    out = torch.empty_like(q)
    torch.ops.tether.paged_attention(out, q, k_cache, v_cache, query_start_loc.contiguous(), seq_lens.contiguous(),
                                     block_table.contiguous(), float(scale), int(sliding_window), float(softcap),
                                     bool(batch_invariant))
    return out


def cpu_store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64, < 0 = skip
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    torch.ops.tether.store_kvcache(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping.long().contiguous())
