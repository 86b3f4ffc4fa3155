"""The vision tower on the replica, and its output cache.

Features are computed when a step first needs an image's tokens (a prefill chunk that overlaps them and
is not served from the prefix cache), for the whole image at once, and kept by image identity (digest and
grid) under a byte budget: a chunked prefill that splits an image, a preempted request, and the same image
in another request or turn reuse them; a cache hit on the tokens never runs the tower at all.
"""

import io
import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from core.messages import ImageInput
from replicas.request.images import PromptImage

MAX_PROCESSED_IMAGES = 64  # decoded and resized images kept by digest, for their requests' admission

logger = logging.getLogger("ray.serve")


def load_vision_encoder(model_dir: str, dtype: torch.dtype, max_cache_bytes: int) -> "VisionEncoder | None":
    """The checkpoint's vision tower and image processor; None for a text-only checkpoint."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" not in config or config.get("image_token_id") is None:
        return None
    from replicas.images.processor import ImageProcessor
    from replicas.models.qwen3_5_vision import load_vision_tower

    tower = load_vision_tower(model_dir, dtype)
    if tower is None:
        return None
    processor = ImageProcessor.from_model_dir(model_dir)
    side = processor.patch_size * processor.merge_size
    logger.info("vision tower: %d blocks, %s; one image token per %dx%d pixels, features cache %d MiB",
                len(getattr(tower, "blocks", [])), str(dtype).removeprefix("torch."), side, side,
                max_cache_bytes >> 20)
    return VisionEncoder(tower.eval(), processor, int(config["image_token_id"]), dtype, max_cache_bytes)


class VisionEncoder:
    def __init__(self, tower: torch.nn.Module, processor, image_token_id: int, dtype: torch.dtype,
                 max_cache_bytes: int):
        self.tower = tower
        self.processor = processor  # replicas/images/processor.py ImageProcessor
        self.image_token_id = image_token_id  # the placeholder the chat template writes, one per image
        self.dtype = dtype
        self.max_cache_bytes = max_cache_bytes
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.num_cache_bytes = 0
        self.num_runs = 0  # images the tower has encoded (a cache hit is not a run)
        self._processed: OrderedDict[str, object] = OrderedDict()  # digest -> ProcessedImage
        self._lock = threading.Lock()

    def processed(self, image: ImageInput):
        """The image decoded, resized and patched (replicas/images/processor.py ProcessedImage), by digest.
        AsyncEngine calls this off the step thread before a request is added, so admission finds it here."""
        from PIL import Image

        with self._lock:
            found = self._processed.get(image.digest)
            if found is not None:
                self._processed.move_to_end(image.digest)
                return found
        with Image.open(io.BytesIO(image.data)) as decoded:
            found = self.processor.process(decoded)
        with self._lock:
            self._processed[image.digest] = found
            while len(self._processed) > MAX_PROCESSED_IMAGES:
                self._processed.popitem(last=False)
        return found

    @torch.inference_mode()
    def features(self, image: PromptImage) -> torch.Tensor:
        """-> [image.span.num_tokens, hidden] in the model's dtype."""
        key = image.cache_key
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return cached
        out = self.tower(image.pixel_values.to(self.dtype), [image.span.grid]).to(self.dtype)
        self.num_runs += 1
        self._keep(key, out)
        return out

    def _keep(self, key: tuple, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_cache_bytes:
            return
        self.cache[key] = features
        self.num_cache_bytes += size
        while self.num_cache_bytes > self.max_cache_bytes:
            _, dropped = self.cache.popitem(last=False)
            self.num_cache_bytes -= dropped.numel() * dropped.element_size()
