"""Loads a checkpoint directory (config.json + *.safetensors) into our model classes, name for name:
- the parts of a merged projection (q/k/v, gate/up: `MergedLinear`) into their rows of the merged weight, or the
  merged weight whole where the checkpoint stores it fused (Phi-3's qkv_proj, gate_up_proj);
- per-expert MoE weights into their expert's slice (a module's `checkpoint_shards`, moe.py);
- through a model's `checkpoint_name` where its checkpoints nest it (Gemma 3's multimodal layout)."""

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_files.architectures import check_architecture
from replicas.cpu_isa import cpu_isa
from replicas.kernels.cpu_linear import PackedLinear, can_pack, pack_linears
from replicas.kernels.cpu_linear.int4 import find_four_bit_linears, int4_backend, use_int4_linears
from replicas.kernels.cpu_linear.int8_native import Int8Linear
from replicas.kernels.cpu_linear.invariant_native import (InvariantBf16WeightLinear, InvariantInt8Linear,
                                                          InvariantLinear, native_invariant,
                                                          use_invariant_linears)
from replicas.kernels.paged_attention import can_use_native_attention
from replicas.kernels.cpu_linear.gguf_blocks import GGUFLinear
from replicas.models.gemma3 import Gemma3ForCausalLM
from replicas.models.gguf_loader import (gguf_file, kept_summary, load_dequantized, load_gguf_weights,
                                        use_gguf_shells)
from replicas.models.layers import MergedLinear, use_native_ops
from replicas.models.llama import LlamaForCausalLM
from replicas.models.gated_deltanet import use_native_recurrent
from replicas.models.moe import use_native_experts
from replicas.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from replicas.models.rope import RotaryEmbedding

logger = logging.getLogger("ray.serve")  # Serve configures it in replicas: these lines reach the replica log

# architectures value -> our class (model_files/architectures.py names the families and the closest ones)
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model; the vision weights are skipped
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # text-only checkpoints (model_type qwen3_5_text)
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,  # model_type qwen3_5_moe_text
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its language model; the engine loads the vision tower
}


def load_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, pack_weights: bool = False,
               int4_decode: bool = False, native: bool = False, batch_invariant: bool = False,
               gguf_blocks: bool = True):
    """-> (model, config). On CPU, each path is chosen by what the host supports (replicas/cpu_isa.py) and
    logged once:
    - `pack_weights`: every linear layer's weight reordered once for oneDNN (bfloat16 ones where the ISA
      allows; replicas/kernels/cpu_linear: the same results, faster matmuls);
    - `int4_decode`: layers whose checkpoint weights are 4-bit groups also keep them as such for
      decode-sized batches (replicas/kernels/cpu_linear/int4.py: the native kernel, else torch's in bf16);
    - `native`: the native attention op and the fused norm / rotary / activation ops where they build;
    - `batch_invariant` (with `native`): every linear on the fixed-order kernel (no packing, no int4 / int8
      decode), attention split by key position only; `model.batch_invariant` says whether it holds;
    - `gguf_blocks`: a GGUF directory's weights stay in their block types (gguf_loader.py); else they are
      dequantized at load into the model's parameters, as a float32 checkpoint's would be."""
    config = load_config(model_dir)
    arch = check_architecture(getattr(config, "architectures", None))  # the clear refusal, with the closest family
    with torch.device("meta"):
        model = ARCHITECTURES[arch](config)
    gguf_path = gguf_file(model_dir)
    if gguf_path is not None and gguf_blocks:  # the layers that keep its blocks are swapped in before allocation
        gguf, targets = use_gguf_shells(model, gguf_path)
    model = model.to_empty(device=device)
    if gguf_path is None or not gguf_blocks:
        model.tie_weights()
    if gguf_path is None:
        _load_weights(model, Path(model_dir))
    else:
        place = _dense_placer(model)  # after the tying: a tied head is the embedding's parameter
        if gguf_blocks:
            kept = load_gguf_weights(model, gguf, targets, device, place, native)
            logger.info("%s", kept_summary(model, kept, gguf_path))
        else:
            load_dequantized(gguf_path, place)
            gguf_path = None  # from here on, the model is a dense checkpoint's
        _check_loaded(model, place, model_dir)
    invariant = batch_invariant and _can_run_invariant(device, native)
    int4 = int4_backend(device, dtype, native) if int4_decode and not invariant and gguf_path is None else None
    # before the cast rounds the weights; batch_invariant keeps them for float32 layers only (exact there)
    four_bit = find_four_bit_linears(model) if int4 or (invariant and dtype == torch.float32 and gguf_path is None) \
        else {}
    gguf_head = isinstance(model.lm_head, GGUFLinear)
    head_weight = None if gguf_head else model.lm_head.weight.detach().clone()  # float32, before the cast rounds it
    model = model.to(dtype)
    if not gguf_head:
        _float32_head(model, head_weight)
    _init_buffers(model, config, device)  # after the cast: rotary tables stay float32
    model.batch_invariant = invariant
    # A Q8_0 head (the default SmolLM2's) keeps its exact 8-bit weights: a quarter of float32's bytes.
    if gguf_head:  # the kept layers are fixed-order already; the rest (an MoE's router) follows the flags
        int8_head = None
        if invariant:
            use_invariant_linears(model, {})
        elif pack_weights and can_pack(device):
            pack_linears(model)
    elif invariant:
        # A Q8_0 head keeps its 8-bit groups; a bf16 checkpoint's float32 head its bf16 values (the same sums)
        int8_head = InvariantInt8Linear.from_weight(head_weight) or \
            InvariantBf16WeightLinear.from_weight(head_weight, model.lm_head.bias)
        model.lm_head = int8_head or model.lm_head
        use_invariant_linears(model, four_bit)  # last: merged projections and the float32 head are final now
        four_bit = {}  # held by the fixed-order layers, not by Int4Linear wrappers
    else:
        if pack_weights and can_pack(device):
            pack_linears(model)
        int8_head = Int8Linear.from_weight(model.lm_head, head_weight) if native and device.type == "cpu" else None
        model.lm_head = int8_head or model.lm_head
    use_int4_linears(model, four_bit, native=int4 == "native")  # around the packed (or plain) layers
    # The native attention op reads the batch's block tables; the model runner builds the padded groups of
    # the PyTorch path only where this is False.
    model.native_attention = native and can_use_native_attention(device)
    num_fused = use_native_ops(model) if native and device.type == "cpu" else 0
    num_native_moe = use_native_experts(model) if native and device.type == "cpu" else 0
    num_native_recurrent = use_native_recurrent(model) if native and device.type == "cpu" else 0
    if device.type == "cpu":
        fixed_order = [m for m in model.modules() if isinstance(m, InvariantLinear)]
        logger.info("CPU paths (ISA %s, %s): batch invariant %s, packed linears %d, fixed-order linears %d (%d with "
                    "4-bit groups), int4 layers %d (%s), head %s, attention %s, fused ops %s, MoE decode %s, "
                    "recurrent layers %s",
                    cpu_isa(), str(dtype).removeprefix("torch."), "on" if invariant else "off",
                    sum(isinstance(m, PackedLinear) for m in model.modules()), len(fixed_order),
                    sum(m.q4 is not None for m in fixed_order), len(four_bit), int4 or "off",
                    "GGUF blocks" if gguf_head else _head_form(int8_head),
                    "native" if model.native_attention else "pytorch", "native" if num_fused else "pytorch",
                    f"native ({num_native_moe} layers)" if num_native_moe else "grouped matmul",
                    f"native ({num_native_recurrent})" if num_native_recurrent else "pytorch")
    return model.eval(), model.config  # a multimodal checkpoint's: its language model's config


def _head_form(head) -> str:
    if isinstance(head, InvariantBf16WeightLinear):
        return "float32 (bf16-exact weights kept in bf16)"
    return "float32" if head is None else "int8 (native)"


def _can_run_invariant(device: torch.device, native: bool) -> bool:
    """Batch invariance needs the fixed-order linear and the native attention op (the PyTorch paths' reduction
    orders follow the batch); where they are missing the engine runs without it, and says so."""
    if device.type != "cpu":
        logger.warning("batch_invariant: CPU only for now; off on %s", device.type)
        return False
    if not native or native_invariant() is None or not can_use_native_attention(device):
        logger.warning("batch_invariant: off, the native ops are %s", "turned off" if not native else "not built")
        return False
    return True


def checkpoint_names(model: torch.nn.Module) -> set[str]:
    """The checkpoint weight names `model` loads: its parameters, merged projections as their parts."""
    return set(_plain_params(model)) | set(_shard_targets(model))


def _plain_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters loaded under their own name (tied weights appear once; merged ones are not here)."""
    merged = {id(param) for param, _ in _shard_targets(model).values()}
    return {n: p for n, p in model.named_parameters() if id(p) not in merged}


def _load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}")
    place = _dense_placer(model)
    for path in files:
        for stored, tensor in load_file(str(path)).items():
            place(stored, tensor, path.name)
    _check_loaded(model, place, model_dir)


def _check_loaded(model: torch.nn.Module, place, where) -> None:
    missing = checkpoint_names(model) - place.loaded
    if missing:
        raise ValueError(f"weights missing from {where}: {sorted(missing)[:5]}")


def _dense_placer(model: torch.nn.Module):
    """-> place(stored name, tensor, where=""): copies one checkpoint tensor into `model`'s parameter for it; the
    names placed so far are `place.loaded`. Raises ValueError for a name the model does not have."""
    shards = _shard_targets(model)
    params = _plain_params(model)
    fused = _fused_names(model, shards)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    loaded = set()

    def place(stored: str, tensor: torch.Tensor, where: str = "") -> None:
        name = rename(stored)
        if name is None:
            return  # weights of a part we do not run (a multimodal checkpoint's vision tower)
        if name in shards:
            param, index = shards[name]
            param.data[index].copy_(tensor)
        elif name in fused:  # a merged projection stored whole: it stands for all its parts
            fused[name][0].data.copy_(tensor)
            loaded.update(fused[name][1])
        elif name in params:
            params[name].data.copy_(tensor)
        elif name == "lm_head.weight" or "rotary_emb" in name:
            return  # tied head, or a buffer we compute
        else:
            raise ValueError(f"unexpected weight {stored!r}" + (f" in {where}" if where else ""))
        loaded.add(name)

    place.loaded = loaded
    return place


def _shard_targets(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, object]]:
    """Checkpoint name of each part of a merged parameter -> (the merged parameter, its index): rows of a
    MergedLinear, an expert's slice of stacked expert weights (`checkpoint_shards`)."""
    targets = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rsplit(".", 1)[0]
            for shard in module.shards:
                rows = module.shard_rows(shard)
                targets[f"{parent}.{shard}.weight"] = (module.weight, rows)
                if module.bias is not None:
                    targets[f"{parent}.{shard}.bias"] = (module.bias, rows)
        elif hasattr(module, "checkpoint_shards"):
            targets.update(module.checkpoint_shards(path))
    return targets


def _fused_names(model: torch.nn.Module, shards: dict) -> dict[str, tuple[torch.nn.Parameter, list[str]]]:
    """A merged projection's own name (`...qkv_proj.weight`, as Phi-3 stores it) -> (its parameter, the part
    names it covers); and a stacked experts parameter's (transformers 5's fused layout) likewise. `shards`:
    _shard_targets(model)."""
    covers: dict[int, list[str]] = {}
    for shard_name, (param, _) in shards.items():
        covers.setdefault(id(param), []).append(shard_name)
    return {name: (param, covers[id(param)]) for name, param in model.named_parameters() if id(param) in covers}


def _float32_head(model: torch.nn.Module, weight: torch.Tensor) -> None:
    """Keeps the LM head in float32 (an untied copy of the checkpoint's `weight`, not of its bf16 rounding)
    when the body is narrower: logits of 10-30 rounded to bfloat16 move by up to 0.125, enough to swap
    close tokens. It costs the head's size again in
    memory and ~3 ms per decode step over a bf16 head on 2 cores (bench/kernels/cpu_linear.py; docs/benchmarks.md
    has a cheaper variant that was tried and not kept)."""
    head = model.lm_head
    if head.weight.dtype == torch.float32:
        return
    fresh = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                            device=head.weight.device, dtype=torch.float32)
    with torch.no_grad():
        fresh.weight.copy_(weight)
        if head.bias is not None:
            fresh.bias.copy_(head.bias)
    model.lm_head = fresh


def _init_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    # Buffers (rotary cos/sin) were made on the meta device; compute them for real.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
