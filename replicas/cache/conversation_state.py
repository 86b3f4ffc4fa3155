"""ConversationState: one conversation's exact state as one self-describing object that can leave its replica.

    layout          what must be equal for the state to mean the same thing elsewhere (StateLayout)
    caller          whose conversation it is: it is imported for that caller only
    history_keys    the retained store's keys for it (one per form the client may send the reply back in)
    token_ids       the retained ids: prompt + reply + the rest of the turn terminator
    block_hashes    chained hashes of the full blocks `kv` covers, a prefix of block_hashes(token_ids)
    kv              [n, L, 2, block_size, Hkv, D]: those blocks' KV, every KV layer (block_io.read_blocks)
    checkpoint      hybrid models: the recurrent state at the turn's end (its partial-block tail inside it);
                    its full blocks are the first checkpoint.num_tokens // block_size of `kv`

The receiver checks everything it can before it trusts any of it (`check`): the layout, the hashes
against the ids, the tensors' shapes. A state that fails is refused whole, never imported in part.
"""

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.hashing import block_hashes
from replicas.cache.checkpoints import Checkpoint

_SAMPLES = 64  # weight-file windows hashed into the model identity
_WINDOW = 1 << 16


@dataclass(frozen=True)
class StateLayout:
    """Equal layouts compute the same KV for the same ids: same weights, precision, kernels and shapes."""

    model: str  # digest of the model's config, tokenizer and weights (model_fingerprint)
    dtype: str
    compute: str  # the device and kernel paths that produced the numbers (another ISA rounds otherwise)
    block_size: int
    kv_block_shape: tuple[int, ...]  # [L, 2, block_size, Hkv, D]
    linear_state_shapes: tuple[tuple[int, ...], ...] = ()  # hybrid: per linear layer, conv then recurrent

    def differences(self, other: "StateLayout") -> list[str]:
        return [name for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]


@dataclass
class ConversationState:
    layout: StateLayout
    caller: str
    history_keys: list[str]
    token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    kv: torch.Tensor | None = None  # [n, L, 2, block_size, Hkv, D]
    checkpoint: Checkpoint | None = None

    @property
    def num_bytes(self) -> int:
        kv = self.kv.numel() * self.kv.element_size() if self.kv is not None else 0
        return kv + (self.checkpoint.num_bytes if self.checkpoint is not None else 0) + 8 * len(self.token_ids)

    def check(self, layout: StateLayout) -> None:
        """Raises StateRefused unless this state can be imported where `layout` holds."""
        differs = self.layout.differences(layout)
        if differs:
            raise StateRefused(f"another layout: {', '.join(differs)} differ")
        num_blocks = len(self.block_hashes)
        if self.block_hashes != block_hashes(self.token_ids, layout.block_size)[:num_blocks]:
            raise StateRefused("the block hashes are not those of the token ids")
        kv_shape = (num_blocks, *layout.kv_block_shape)
        if num_blocks and (self.kv is None or tuple(self.kv.shape) != kv_shape or str(self.kv.dtype) != layout.dtype):
            raise StateRefused(f"the KV is not {kv_shape} {layout.dtype}")
        if self.checkpoint is not None:
            self._check_checkpoint(layout)

    def _check_checkpoint(self, layout: StateLayout) -> None:
        cp = self.checkpoint
        if not 0 < cp.num_tokens < len(self.token_ids) or cp.num_tokens // layout.block_size > len(self.block_hashes):
            raise StateRefused("the checkpoint is not inside the exported prefix")
        shapes = tuple(tuple(t.shape) for pair in zip(cp.conv_states, cp.recurrent_states) for t in pair)
        if shapes != layout.linear_state_shapes:
            raise StateRefused("the checkpoint's recurrent states have another shape")
        tail = cp.num_tokens % layout.block_size
        if any(k.shape[0] != tail or v.shape[0] != tail for k, v in cp.tail_kv):
            raise StateRefused("the checkpoint's tail KV does not match its length")


class StateRefused(ValueError):
    """A state this replica will not import: why."""


def model_fingerprint(model_dir: str) -> str:
    """A digest of the model's config, tokenizer files and weights. The weights are sampled (their size and
    64 windows of 64 KiB spread over each file) so a start-up pays milliseconds, not a read of every byte; a
    fine-tune changes every window."""
    digest = hashlib.blake2b(digest_size=16)
    root = Path(model_dir)
    for path in sorted(root.iterdir()):
        if path.suffix == ".json" or path.suffix == ".model":
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".gguf"):
            digest.update(path.name.encode() + b"\0" + _sampled(path))
    return digest.hexdigest()


def _sampled(path: Path) -> bytes:
    size = os.path.getsize(path)
    parts = [str(size).encode()]
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _WINDOW) * i // max(1, _SAMPLES - 1)))
            parts.append(f.read(_WINDOW))
    return b"".join(parts)


def compute_identity(device: torch.device, config) -> str:
    """The kernel paths an engine computes with, as one string (EngineConfig fields that change numbers)."""
    from replicas.cpu_isa import cpu_isa

    where = f"cpu:{cpu_isa()}" if device.type == "cpu" else device.type
    return json.dumps({"device": where, "native": config.native_kernels, "packed": config.pack_weights,
                       "int4_decode": config.int4_decode, "batch_invariant": config.batch_invariant},
                      sort_keys=True)
