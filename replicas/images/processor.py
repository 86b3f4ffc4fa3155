"""ImageProcessor: a PIL image -> the flattened patches and grid a Qwen3.5 / Qwen3-VL vision tower reads.

Exactly transformers' Qwen2VLImageProcessorPil (qwen2_vl/image_processing_pil_qwen2_vl.py), step for step:
  1. RGB: images with alpha (RGBA, LA, P with transparency) are composited onto white, others converted;
  2. resize (PIL bicubic) to smart_resize's size: each side a multiple of patch * merge, area in
     [min_pixels, max_pixels], aspect ratio kept as nearly as possible;
  3. rescale in float64, then float32; normalize (x - mean) / std in float32;
  4. patchify in spatial-merge order: the merge x merge patches of each merged token are consecutive, and
     each patch is repeated temporal_patch_size times (an image is a one-frame video).
Steps 2-4 run in numpy because the float arithmetic must be the same as transformers' to the last bit.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Qwen3-VL / Qwen3.5 checkpoints' preprocessor_config.json (transformers' Qwen2VL defaults are Qwen2-VL's:
# patch 14 and CLIP mean/std).
DEFAULTS = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                min_pixels=65536, max_pixels=16777216,
                image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                do_rescale=True, rescale_factor=1 / 255, do_normalize=True)
MAX_ASPECT_RATIO = 200


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, C * T * P * P] float32, merge order
    grid_thw: tuple[int, int, int]  # in patches (before the spatial merge)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of factor with area in [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be under {MAX_ASPECT_RATIO}, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels become white, as transformers' convert_to_rgb does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = DEFAULTS["patch_size"]
    merge_size: int = DEFAULTS["merge_size"]
    temporal_patch_size: int = DEFAULTS["temporal_patch_size"]
    min_pixels: int = DEFAULTS["min_pixels"]
    max_pixels: int = DEFAULTS["max_pixels"]
    image_mean: tuple[float, ...] = DEFAULTS["image_mean"]
    image_std: tuple[float, ...] = DEFAULTS["image_std"]
    do_rescale: bool = DEFAULTS["do_rescale"]
    rescale_factor: float = DEFAULTS["rescale_factor"]
    do_normalize: bool = DEFAULTS["do_normalize"]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ImageProcessor":
        """From preprocessor_config.json when the checkpoint has one, else the Qwen3.5 defaults. As in
        transformers, top-level min_pixels / max_pixels win over size.shortest_edge / size.longest_edge."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        fields = dict(min_pixels=min_pixels, max_pixels=max_pixels,
                      image_mean=tuple(raw["image_mean"]) if "image_mean" in raw else None,
                      image_std=tuple(raw["image_std"]) if "image_std" in raw else None,
                      **{k: raw.get(k) for k in ("patch_size", "merge_size", "temporal_patch_size",
                                                 "do_rescale", "rescale_factor", "do_normalize")})
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid_for(self, width: int, height: int) -> tuple[int, int, int]:
        """The grid (t, h, w) in patches an image of this size gets, without touching pixels."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens (= vision tower outputs) for one image: one per merge x merge patches."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2

    def process(self, image: Image.Image) -> ProcessedImage:
        rgb = to_rgb(image)
        _, grid_h, grid_w = self.grid_for(*rgb.size)
        size = (grid_w * self.patch_size, grid_h * self.patch_size)  # PIL's (width, height)
        pixels = np.asarray(rgb.resize(size, resample=Image.Resampling.BICUBIC)).transpose(2, 0, 1)  # [C, H, W]
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32, copy=False)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        patches = self._patchify(pixels, grid_h, grid_w)
        return ProcessedImage(torch.from_numpy(patches), (1, grid_h, grid_w))

    def _patchify(self, pixels: np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
        """[C, H, W] -> [grid_h * grid_w, C * T * P * P], rows in merge order:

            (block_row, block_col, in_row, in_col)   with  row = block_row * M + in_row, col likewise
        """
        channels, p, m, t = pixels.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
        x = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/M, gw/M, M, M, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the frame, T times
        return np.ascontiguousarray(x.reshape(grid_h * grid_w, channels * t * p * p))
