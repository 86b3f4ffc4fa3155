"""Images on the replica, through the real Engine, against transformers' Qwen3_5ForConditionalGeneration on a
tiny random checkpoint (testing/tiny_vision.py): greedy tokens equal for one image, two of different sizes,
an image first or mid-text, batched with text-only requests, with chunked prefill splitting an image; the
placeholder count must match the images; two images of the same size never share a block; a later turn
served from cache never runs the vision tower again."""

import hashlib
import io

import numpy as np
import pytest
import torch

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, ImageInput, RequestError, SamplingParams
from replicas.engine.engine import Engine
from tests.engine.conftest import run_all as run

NUM_STEPS = 32


@pytest.fixture(scope="module")
def vl_dir(smollm2_dir, tmp_path_factory):
    from testing.tiny_vision import make_tiny_qwen3_5_vl

    return make_tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3_5-vl"), smollm2_dir)


@pytest.fixture(scope="module")
def reference(vl_dir):
    import json

    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    settings = json.loads((vl_dir / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type", None)
    return model, Qwen2VLImageProcessorPil(**settings)


@pytest.fixture(scope="module")
def ids(vl_dir):
    return ids_of(vl_dir)


def make_image(width: int, height: int, seed: int) -> ImageInput:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    data = out.getvalue()
    return ImageInput(data, width, height, hashlib.sha256(data).hexdigest())


def text(seed: int, length: int) -> list[int]:
    return torch.randint(10, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_image(ids, *parts) -> list[int]:
    """Text lists and "IMG" markers -> ids with <|vision_start|><|image_pad|><|vision_end|> per image."""
    start, pad, end = ids
    out = []
    for part in parts:
        out += [start, pad, end] if part == "IMG" else part
    return out


def reference_greedy(reference, ids, prompt: list[int], images: list[ImageInput]) -> list[int]:
    from PIL import Image

    model, processor = reference
    pad = ids[1]
    expanded, types, pixels, grids = [], [], [], []
    queue = list(images)
    for token in prompt:
        if token != pad:
            expanded.append(token)
            types.append(0)
            continue
        out = processor(images=[Image.open(io.BytesIO(queue.pop(0).data))], return_tensors="pt")
        num = int(out["image_grid_thw"][0].prod()) // 4
        expanded += [pad] * num
        types += [1] * num
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    kwargs = dict(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids)) if pixels else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([expanded]), mm_token_type_ids=torch.tensor([types]),
                             max_new_tokens=NUM_STEPS, do_sample=False, **kwargs)
    return out[0, len(expanded):].tolist()


def request(rid: str, prompt: list[int], images=(), max_tokens: int = NUM_STEPS) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           images=list(images))


def same_prefix(ours: list[int], theirs: list[int]) -> None:
    """transformers stops at EOS; ours ignores it: equal up to transformers' end."""
    assert ours[:len(theirs)] == theirs


@pytest.fixture(scope="module")
def engine(vl_dir):
    return Engine(EngineConfig(model=str(vl_dir), dtype="float32"))


CASES = {
    "one image mid-text": (lambda i: with_image(i, text(1, 9), "IMG", text(2, 7)), [(64, 96)]),
    "an image first": (lambda i: with_image(i, "IMG", text(3, 5)), [(128, 64)]),
    "two images of different sizes": (lambda i: with_image(i, text(4, 6), "IMG", text(5, 3), "IMG", text(6, 4)),
                                      [(64, 64), (160, 96)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(engine, reference, ids, case):
    build, sizes = CASES[case]
    images = [make_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    prompt = build(ids)
    ours = run(engine, [request("r", prompt, images)])["r"]
    same_prefix(ours, reference_greedy(reference, ids, prompt, images))


def test_batched_with_text_and_chunked_through_an_image(vl_dir, reference, ids):
    """Chunks of 16 tokens: the 40-token image is split across three steps; text-only requests share them."""
    engine = Engine(EngineConfig(model=str(vl_dir), dtype="float32", max_num_batched_tokens=16,
                                 max_num_seqs=4))
    image = make_image(256, 160, 7)  # 8 x 5 merged tokens
    prompt = with_image(ids, text(8, 5), "IMG", text(9, 6))
    plain = [text(10, 11), text(11, 4)]
    out = run(engine, [request("img", prompt, [image]), *(request(f"t{k}", p) for k, p in enumerate(plain))])
    same_prefix(out["img"], reference_greedy(reference, ids, prompt, [image]))
    for k, p in enumerate(plain):
        same_prefix(out[f"t{k}"], reference_greedy(reference, ids, p, []))
    assert engine.vision.num_runs == 1  # split across chunks, encoded once


def test_placeholders_must_match_the_images(engine, ids):
    image = make_image(64, 64, 1)
    with pytest.raises(RequestError, match="placeholder") as two_for_one:
        engine.add_request(request("x", with_image(ids, text(1, 3), "IMG", "IMG"), [image]))
    with pytest.raises(RequestError, match="image") as none_for_one:
        engine.add_request(request("y", text(1, 3), [image]))
    assert two_for_one.value.param == none_for_one.value.param == "messages"
    assert not engine.has_unfinished()


def test_two_images_of_one_size_never_share_a_block(vl_dir, ids):
    from core.hashing import block_hashes
    from replicas.request.images import expand_images

    engine = Engine(EngineConfig(model=str(vl_dir), dtype="float32"))
    prompt = with_image(ids, text(12, 16), "IMG", text(13, 3))  # the image starts at token 17
    first, second = make_image(128, 128, 20), make_image(128, 128, 21)  # 16 tokens each
    vision, vocab, size = engine.vision, engine.model_config.vocab_size, engine.config.block_size
    a, _ = expand_images(prompt, [first], vision, vision.image_token_id, vocab)
    b, _ = expand_images(prompt, [second], vision, vision.image_token_id, vocab)
    hashes_a, hashes_b = block_hashes(a, size, None), block_hashes(b, size, None)
    image_block = 17 // size
    assert len(a) == len(b) and len(hashes_a) > image_block
    assert hashes_a[:image_block] == hashes_b[:image_block]
    assert all(x != y for x, y in zip(hashes_a[image_block:], hashes_b[image_block:]))
    run(engine, [request("a", prompt, [first], max_tokens=1)])
    cached_before = engine.stats.num_prompt_tokens_cached
    run(engine, [request("b", prompt, [second], max_tokens=1)])
    assert engine.stats.num_prompt_tokens_cached - cached_before <= 17  # nothing from the image on
    assert engine.vision.num_runs == 2


def test_later_turns_reuse_the_image_from_cache(vl_dir, reference, ids):
    """Turn 1 has an image; turns 2 and 3 add text. Each later turn is served from the prefix cache and the
    turn-end state checkpoint up to its new text: the vision tower ran once, and the tokens equal a cold run."""
    engine = Engine(EngineConfig(model=str(vl_dir), dtype="float32"))
    image = make_image(128, 96, 30)
    prompt = with_image(ids, text(31, 7), "IMG", text(32, 5))
    for turn in range(3):
        reply = run(engine, [request(f"turn{turn}", prompt, [image], max_tokens=6)])[f"turn{turn}"]
        if turn:
            assert engine.stats.num_prompt_tokens_computed - computed_before <= len(new) + 1
        same_prefix(reply, reference_greedy(reference, ids, prompt, [image])[:6])
        computed_before = engine.stats.num_prompt_tokens_computed
        new = text(40 + turn, 4)
        prompt = prompt + reply + new
    assert engine.vision.num_runs == 1


def test_preemption_recomputes_images_exactly(vl_dir):
    """A KV pool too small for all four: sequences are preempted and recomputed, images and M-RoPE included;
    tokens equal a roomy run's."""
    images = [make_image(64 + 32 * k, 96, 50 + k) for k in range(4)]

    def requests():
        return [request(f"r{k}", with_image(ids_of(vl_dir), text(60 + k, 5 + k), "IMG", text(70 + k, 3)), [image],
                        max_tokens=24) for k, image in enumerate(images)]

    roomy = run(Engine(EngineConfig(model=str(vl_dir), dtype="float32")), requests())
    tight = Engine(EngineConfig(model=str(vl_dir), dtype="float32", num_kv_blocks=24, block_size=4, max_num_seqs=4))
    assert run(tight, requests()) == roomy
    assert tight.scheduler.num_preemptions > 0


def ids_of(vl_dir) -> tuple[int, int, int]:
    import json

    config = json.loads((vl_dir / "config.json").read_text())
    return config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]
