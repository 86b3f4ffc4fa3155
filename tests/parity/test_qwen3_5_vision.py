"""Images for Qwen3.5 vs transformers:
(a) replicas/images/processor.py == Qwen2VLImageProcessorPil (the PIL backend: the torchvision one does not
    import beside our CPU torch) on RGB, RGBA, grayscale, too-large and too-small images, exactly;
(b) grid_for(width, height), from the size alone, == the processor's grid;
(c) replicas/models/qwen3_5_vision.py == Qwen3_5ForConditionalGeneration's image features on the tiny
    checkpoint (testing/tiny_vision.py), float32, one image and two of different sizes in one call;
(d) load_vision_tower: strict on the tiny checkpoint; None for a text-only one.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from replicas.images.processor import ImageProcessor
from replicas.models.qwen3_5_vision import Qwen3_5VisionTower, load_vision_tower, read_vision_weights

TOL = 1e-5
MIN_PIXELS, MAX_PIXELS = 4 * 32 * 32, 64 * 32 * 32  # as testing/tiny_vision.py's preprocessor_config.json


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    if mode == "RGBA":
        pixels[: height // 2, :, 3] = 0  # half transparent: it must turn white
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


IMAGES = {
    "rgb_100x60": (100, 60, "RGB"),
    "rgb_333x517": (333, 517, "RGB"),
    "rgba": (90, 70, "RGBA"),
    "gray": (64, 128, "L"),
    "over_max_pixels": (1000, 800, "RGB"),
    "under_min_pixels": (20, 30, "RGB"),
}


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    from testing.tiny_vision import make_tiny_qwen3_5_vl

    return make_tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3_5-vl"))


@pytest.fixture(scope="module")
def processors(tiny_vl_dir):
    """(ours, transformers') from the tiny checkpoint's preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return ImageProcessor.from_model_dir(tiny_vl_dir), Qwen2VLImageProcessorPil.from_pretrained(str(tiny_vl_dir))


@pytest.fixture(scope="module")
def reference(tiny_vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_vl_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", IMAGES)
def test_processor_matches_transformers(processors, name):
    ours, theirs = processors
    image = random_image(*IMAGES[name])
    expected = theirs(image, return_tensors="pt")
    got = ours.process(image)
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    assert got.pixel_values.dtype == torch.float32
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], atol=1e-6, rtol=0)
    assert ours.grid_for(*image.size) == got.grid_thw
    assert ours.num_tokens(got.grid_thw) * 4 == got.pixel_values.shape[0]


def test_defaults_are_qwen3_5s(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ours = ImageProcessor.from_model_dir(tmp_path)  # no preprocessor_config.json
    theirs = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3, min_pixels=65536, max_pixels=16777216)
    image = random_image(300, 200)
    expected = theirs(image, return_tensors="pt")
    got = ours.process(image)
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist() == [[1, 14, 20]]  # up to min_pixels
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("width,height", [(1, 1), (31, 33), (4000, 3000), (32, 6000), (500, 499)])
def test_grid_for_matches_transformers(processors, width, height):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ours, theirs = processors
    t, h, w = ours.grid_for(width, height)
    assert (t, h * 16, w * 16) == (1, *smart_resize(height, width, 32, MIN_PIXELS, MAX_PIXELS))
    assert h * w == theirs.get_number_of_image_patches(height, width)
    # no bound on tokens from max_pixels alone: at 32x6000 the floor of one factor per side gives 218 x 2
    # patches, 109 tokens over max_pixels' 64: callers count with grid_for


def image_features(model, pixel_values, grids) -> torch.Tensor:
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values, torch.tensor(grids))
    return torch.cat(out.pooler_output)  # a tuple, one [tokens_i, out_hidden] per image


@pytest.mark.parametrize("names", [["rgb_333x517"], ["rgb_100x60", "rgba"], ["gray", "over_max_pixels"]])
def test_vision_tower_matches_transformers(tiny_vl_dir, processors, reference, names):
    tower = load_vision_tower(tiny_vl_dir)
    processed = [processors[0].process(random_image(*IMAGES[name], seed=i)) for i, name in enumerate(names)]
    pixel_values = torch.cat([p.pixel_values for p in processed])
    grids = [p.grid_thw for p in processed]
    with torch.inference_mode():
        got = tower(pixel_values, grids)
    expected = image_features(reference, pixel_values, grids)
    assert got.shape == (sum(processors[0].num_tokens(g) for g in grids), reference.config.text_config.hidden_size)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_load_is_strict_and_by_name(tiny_vl_dir, reference):
    tower = load_vision_tower(tiny_vl_dir)
    assert isinstance(tower, Qwen3_5VisionTower)
    state = read_vision_weights(tiny_vl_dir)
    assert set(state) == set(tower.state_dict())
    assert set(state) == {k.removeprefix("model.visual.") for k in reference.state_dict() if ".visual." in f".{k}"}
    Qwen3_5VisionTower(reference.config.vision_config).load_state_dict(state, strict=True)  # config object too
    assert load_vision_tower(tiny_vl_dir, dtype=torch.bfloat16).pos_embed.weight.dtype == torch.bfloat16


def test_text_only_checkpoint_has_no_tower(tiny_vl_dir, tmp_path):
    text_only = json.loads((tiny_vl_dir / "config.json").read_text())["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(text_only))
    assert load_vision_tower(tmp_path) is None
    # a vision_config but no vision weights: a checkpoint whose tower was stripped
    from safetensors.torch import load_file, save_file

    no_vision = tmp_path / "stripped"
    no_vision.mkdir()
    (no_vision / "config.json").write_text((tiny_vl_dir / "config.json").read_text())
    text_weights = {k: v for k, v in load_file(str(tiny_vl_dir / "model.safetensors")).items() if "visual" not in k}
    save_file(text_weights, str(no_vision / "model.safetensors"))
    assert load_vision_tower(no_vision) is None
