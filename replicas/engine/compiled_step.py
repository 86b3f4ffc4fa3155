"""CompiledForward: the model's forward as one Inductor graph for every batch shape (engine.compile_step).

What a one-stream decode step of SmolLM2 spends outside the kernels is Python: ~30 layers x ~10 module calls,
views and wrappers, 1.4-1.9 ms of an ~11 ms step on a 2-core host (docs/benchmarks.md, "The compiled
step"). torch.compile traces the forward once with every native op as a custom op with a fake implementation
(replicas/kernels/native_build.py), so the graph calls the kernels straight from its generated code.

One graph, compiled at start-up (`warm_up`), never again:
- the step's token, sequence and block counts are unbacked sizes (`mark_unbacked`): no 0/1 specialisation, so
  1 token and 1,000 take the same graph; the rest of the shapes (hidden size, KV pool) are static;
- the RMSNorms' float32 weights are made before tracing (a dict filled on first use would be a guard);
- it runs under inference mode like every step, so the tensors' dispatch keys match the trace.
Inductor's cache lives under the project cache (core/env.py), so a restart reuses the compiled code and pays
only the trace: SmolLM2 ~32 s cold, ~6 s from the cache, on 2 cores.

Steps the graph does not cover run eagerly: a step with images (M-RoPE positions, vision rows). If tracing
or compiling fails, the forward stays eager for good and the log says why; so do engines it does not apply
to (`compile_support`: CUDA, no native ops, batch invariance off, a hybrid model whose recurrent layers are not on
their native ops). A hybrid model's forward takes the step's LinearStateBatch too: the native recurrent ops read
only its slots and flags (as many as the step's sequences: unbacked) and the state tensors (static).
"""

import logging
import os
import time
from types import SimpleNamespace

import torch

from core.env import inductor_cache_dir
from replicas.cpu_isa import cpu_isa
from replicas.models.forward_batch import ForwardBatch
from replicas.models.gated_deltanet import GatedDeltaNet, LinearStateBatch
from replicas.models.layers import RMSNorm

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log

# ForwardBatch tensors and the dims that vary from step to step (the rest of their shapes is fixed).
STEP_DIMS = {"input_ids": (0,), "positions": (0,), "slot_mapping": (0,), "cu_seqlens": (0,),
             "query_start_loc": (0,), "seq_lens": (0,), "block_table": (0, 1)}


def host_key() -> str:
    """What compiled code depends on beyond Inductor's own key: the ISA level the native ops were built for
    (TETHER_CPU_ISA caps it) and ATen's (ATEN_CPU_CAPABILITY), as make test-avx2 sets them."""
    return f"{cpu_isa()}-aten-{os.environ.get('ATEN_CPU_CAPABILITY', 'native').lower()}"


def compile_support(model, device: torch.device) -> str | None:
    """Why the forward cannot be compiled here, or None when it can."""
    if device.type != "cpu":
        return f"device {device.type}: the CPU step only"
    if not getattr(model, "native_attention", False):
        return "the native ops are off (the PyTorch attention path's groups are Python lists)"
    if not getattr(model, "batch_invariant", False):
        return ("batch_invariant is off: the int4 / int8 / oneDNN linears choose their kernel by the row count in "
                "Python, which one graph for every batch cannot hold")
    if getattr(model, "linear_attention_layers", None) and not all(
            module.native is not None for module in model.modules() if isinstance(module, GatedDeltaNet)):
        return "hybrid model with its recurrent layers on the PyTorch path (loops over sequences and groups)"
    return None


class CompiledForward:
    """Calls `model(input_ids, positions, kv_caches, batch)`: through the compiled graph where it applies."""

    def __init__(self, model):
        self.eager = model.forward
        for module in model.modules():  # the norms' float32 weights exist before the trace
            if isinstance(module, RMSNorm) and module.native:
                for dtype in (torch.float32, module.weight.dtype):
                    module._native_weight(dtype)
        self.cache_dir = inductor_cache_dir(host_key())  # exported before Inductor first reads it
        # One graph per model; a process that serves many (the test suite) keeps each. Past the limit Dynamo
        # would run eagerly without a word: raise instead, so the fallback below logs it.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self.graph = torch.compile(self.eager, fullgraph=True, dynamic=None)
        self.compiled = False  # True once the graph has run
        self.compile_seconds: float | None = None

    def __call__(self, input_ids, positions, kv_caches, batch: ForwardBatch, *linear_state) -> torch.Tensor:
        """linear_state: a hybrid model's LinearStateBatch (one argument), else nothing."""
        args = (input_ids, positions, kv_caches, batch, *linear_state)
        if self.graph is None or batch.mrope_positions is not None or batch.image_embeds is not None:
            return self.eager(*args)
        for name, dims in STEP_DIMS.items():
            tensor = getattr(batch, name)
            for dim in dims:
                torch._dynamo.decorators.mark_unbacked(tensor, dim)
        for step in linear_state:
            for tensor in (step.state_slots, step.has_initial_state, step.snapshot_rows,
                           *(t for layer in step.snapshots for t in (layer.conv_state, layer.recurrent_state))):
                torch._dynamo.decorators.mark_unbacked(tensor, 0)
        if self.compiled:
            return self.graph(*args)
        start = time.perf_counter()
        try:
            out = self.graph(*args)
        except Exception as error:  # a tracing or lowering failure: eager from now on
            logger.warning("compiled step: compiling failed (%s: %s); the forward stays eager",
                           type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            self.graph = None
            return self.eager(*args)
        self.compiled, self.compile_seconds = True, time.perf_counter() - start
        logger.info("compiled step: one graph in %.1f s (Inductor cache %s)", self.compile_seconds, self.cache_dir)
        return out

    @property
    def active(self) -> bool:
        return self.graph is not None


def warm_up_scheduled(block_table: list[int]) -> list:
    """A one-token step that writes only slot 0 of block `block_table[0]` (free at start-up): what `ModelRunner`
    runs once so the graph compiles before the first request (a hybrid model's: from state slot 0, which it
    overwrites, as every sequence's first step does). Duck-types `ScheduledRequest`."""
    request = SimpleNamespace(num_computed_tokens=0, token_ids=[0], block_table=block_table, images=[],
                              num_tokens=1, state_slot=0, checkpoint_positions=set())
    return [SimpleNamespace(request=request, num_tokens=1, samples=True)]
