"""Qwen3.5 vision tower (model_type `qwen3_5_vision`, the `model.visual` of Qwen3_5ForConditionalGeneration):
flattened image patches -> one embedding per merged 2x2 patch block, the rows the text model puts in place of
its image placeholder tokens.

  1. patch embedding: the Conv3d whose kernel = stride = (T, P, P) is one matmul on each flattened patch;
  2. + the learned square position table, bilinearly resampled (align_corners) to each image's grid;
  3. ViT blocks: pre-LayerNorm, full non-causal attention within each frame (2-D rotary on (row, col)), MLP;
  4. merger: LayerNorm, then each 2x2 block's four patches side by side -> MLP to the text hidden size.

Patches arrive in merge order (replicas/images/processor.py), so steps 2 and the rotary lay their grids out
the same way and step 4 is a reshape. Parameter names are HF's `model.visual.*` without the prefix, so
`load_state_dict` of the stripped checkpoint is strict. Checked against transformers' modeling_qwen3_5.py
(Qwen3_5VisionModel) in tests/parity/test_qwen3_5_vision.py.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
               "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def _field(config, name: str, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def merge_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] -> [h * w, ...] with each merge x merge block's patches consecutive (the processor's order)."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *grid.shape[2:])


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden: int):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel, bias=True)  # checkpoint's shape

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, C * T * P * P] -> [N, hidden]
        weight = self.proj.weight.flatten(1)  # [hidden, C * T * P * P], the same (C, T, P, P) order
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        # x: [N, hidden]; cos, sin: [N, D] float32; seqlens: patches per frame, summing to N
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, H, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))]  # each [H, n_i, D]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in float32. x: [N, H, D]; cos, sin: [N, D]."""
    xf = x.float()
    half = torch.cat((-xf[..., xf.shape[-1] // 2:], xf[..., : xf.shape[-1] // 2]), dim=-1)
    return (xf * cos[:, None] + half * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, act: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x, cos, sin, seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int, out_hidden: int):
        super().__init__()
        self.merged = hidden * merge * merge
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, out_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, hidden] in merge order -> [N / merge^2, out_hidden]
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionTower(nn.Module):
    def __init__(self, vision_config):
        super().__init__()
        hidden = _field(vision_config, "hidden_size")
        self.num_heads = _field(vision_config, "num_heads")
        self.merge = _field(vision_config, "spatial_merge_size", 2)
        self.head_dim = hidden // self.num_heads
        self.rope_theta = float(_field(_field(vision_config, "rope_parameters", {}), "rope_theta", 10000.0))
        num_positions = _field(vision_config, "num_position_embeddings")
        self.side = int(num_positions ** 0.5)  # the learned table is side x side
        self.patch_embed = PatchEmbed(_field(vision_config, "in_channels", 3),
                                      _field(vision_config, "temporal_patch_size", 2),
                                      _field(vision_config, "patch_size", 16), hidden)
        self.pos_embed = nn.Embedding(num_positions, hidden)
        act = _field(vision_config, "hidden_act", "gelu_pytorch_tanh")
        self.blocks = nn.ModuleList(
            VisionBlock(hidden, self.num_heads, _field(vision_config, "intermediate_size"), act)
            for _ in range(_field(vision_config, "depth")))
        self.merger = PatchMerger(hidden, self.merge, _field(vision_config, "out_hidden_size"))

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [N, C * T * P * P], the images' patches one after another in merge order, N = sum of
        t * h * w over grid_thw. -> [sum(t * h * w / merge^2), out_hidden_size], image after image."""
        x = self.patch_embed(pixel_values)  # [N, hidden]
        positions, rotary, seqlens = [], [], []
        for t, h, w in grid_thw:
            positions.append(self._position_table(h, w).repeat(t, 1))
            rotary.append(self._rotary_angles(h, w).repeat(t, 1))
            seqlens += [h * w] * t  # attention stays within a frame
        x = x + torch.cat(positions).to(x.dtype)
        angles = torch.cat(rotary)  # [N, D] float32
        cos, sin = angles.cos(), angles.sin()
        for block in self.blocks:
            x = block(x, cos, sin, seqlens)
        return self.merger(x)

    def _position_table(self, h: int, w: int) -> torch.Tensor:
        """The side x side learned table resampled bilinearly (align_corners=True) to h x w -> [h * w, hidden]
        float32 in merge order. Done one axis at a time: the same weights as transformers' 4-tap gather."""
        table = self.pos_embed.weight.float().view(self.side, self.side, -1)  # [side, side, hidden]
        rows_taps, rows_weights = self._axis_taps(h)  # [h, 2] each
        cols_taps, cols_weights = self._axis_taps(w)  # [w, 2] each
        rows = (table[rows_taps] * rows_weights[:, :, None, None]).sum(1)  # [h, side, hidden]
        grid = (rows[:, cols_taps] * cols_weights[None, :, :, None]).sum(2)  # [h, w, hidden]
        return merge_order(grid, self.merge)

    def _axis_taps(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of `size` target positions: the two table rows around it and their linear weights.
        Endpoints map to 0 and side - 1 (align_corners); the upper tap is clamped, with weight 0 there."""
        device = self.pos_embed.weight.device
        src = torch.arange(size, dtype=torch.float32, device=device) * (self.side - 1) / max(size - 1, 1)
        floor = src.floor()
        offsets = torch.arange(2, device=device)
        taps = (floor.long()[:, None] + offsets).clamp(max=self.side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    def _rotary_angles(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D] float32 angles in merge order: a quarter of the head's frequencies on the row, a quarter on
        the column, both halves of rotate-half repeated: [row | col | row | col]."""
        device = self.pos_embed.weight.device
        quarter = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        coords = merge_order(torch.stack([rows, cols], dim=-1), self.merge)  # [h * w, 2]
        freqs = (coords[..., None].float() * inv_freq).flatten(1)  # [h * w, D / 2]: rows' then cols'
        return torch.cat([freqs, freqs], dim=-1)


def load_vision_tower(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3_5VisionTower | None:
    """The checkpoint's vision tower, or None when it has none (no vision_config, or no `model.visual.*` /
    `visual.*` weights). Built on the meta device and assigned the checkpoint tensors: strict, by name."""
    model_dir = Path(model_dir)
    vision_config = json.loads((model_dir / "config.json").read_text()).get("vision_config")
    if vision_config is None:
        return None
    state = read_vision_weights(model_dir)
    if not state:
        return None
    with torch.device("meta"):
        tower = Qwen3_5VisionTower(vision_config)
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.to(dtype).eval()


def read_vision_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's vision weights, prefix stripped; only the shards that hold some are opened."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for name, f in weight_map.items() if _strip(name) is not None})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    state = {}
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                if (stripped := _strip(name)) is not None:
                    state[stripped] = shard.get_tensor(name)
    return state


def _strip(name: str) -> str | None:
    for prefix in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None
