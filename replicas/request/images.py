"""A request's images on the replica: each placeholder expanded to its image's tokens (seed 001's contract).

The ingress renders ONE registered placeholder token per image (`<|image_pad|>`, the model's
image_token_id) and sends the checked images beside the ids. Here each placeholder becomes the image's
feature count of tokens; a count that does not match (placeholders != images) is an error, never a guess.

An image's tokens are not the placeholder id repeated: they carry a value of their own, past the
vocabulary, derived from the image's digest (as SGLang pads them). So everything keyed by token ids tells
two images apart without knowing about images: block hashes (two images of the same size never share a
block), retained conversations, hybrid checkpoints. The model replaces those rows' embeddings with the
vision features (Qwen3_5TextModel.embed); nothing samples or detokenizes them.
"""

from dataclasses import dataclass

import torch

from core.messages import ImageInput, RequestError
from replicas.models.mrope import ImageSpan

IMAGE_VALUE_RANGE = 1 << 40  # image token values: vocab_size + (digest mod this)


@dataclass(slots=True)
class PromptImage:
    span: ImageSpan  # where its tokens sit in the sequence, and its grid
    digest: str  # the image's identity (sha256 of its bytes) + the processor's grid: the encoder cache key
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, C * T * P * P] float32, the processor's

    @property
    def cache_key(self) -> tuple[str, tuple[int, int, int]]:
        return self.digest, self.span.grid


def image_token_value(digest: str, vocab_size: int) -> int:
    return vocab_size + int(digest[:16], 16) % IMAGE_VALUE_RANGE


def is_image_token(token_id: int, vocab_size: int) -> bool:
    return token_id >= vocab_size


def expand_images(prompt_ids: list[int], images: list[ImageInput], vision, image_token_id: int,
                  vocab_size: int) -> tuple[list[int], list[PromptImage]]:
    """-> (the prompt with each placeholder replaced by its image's tokens, the images in order).
    `images` are all of the conversation's, in order; `vision.processed(image)` gives each one's pixels and grid
    (replicas/engine/vision_encoder.py, cached by digest). A run of image tokens already in the prompt (a retained
    conversation's ids) is an earlier image, expanded on an earlier turn: it must be the next image's run.
    Raises RequestError (400, param "messages") when placeholders and images do not pair up."""
    ids, prompt_images, pending = [], [], list(images)
    i = 0
    while i < len(prompt_ids):
        token = prompt_ids[i]
        if token != image_token_id and not is_image_token(token, vocab_size):
            ids.append(token)
            i += 1
            continue
        if not pending:
            raise RequestError(f"messages: the prompt has more image placeholders than the {len(images)} "
                               "image(s) sent", param="messages")
        image = _prompt_image(pending.pop(0), vision, len(ids))
        value = image_token_value(image.digest, vocab_size)
        if token == image_token_id:  # a placeholder: this image's tokens
            i += 1
        else:  # already expanded: exactly this image's run
            run = image.span.num_tokens
            if prompt_ids[i:i + run] != [value] * run or (i + run < len(prompt_ids) and prompt_ids[i + run] == value):
                raise RequestError("messages: the conversation's kept ids do not match its images",
                                   param="messages")
            i += run
        ids += [value] * image.span.num_tokens
        prompt_images.append(image)
    if pending:
        raise RequestError(f"messages: {len(images)} image(s) sent for {len(prompt_images)} image placeholder(s)",
                           param="messages")
    return ids, prompt_images


def _prompt_image(image: ImageInput, vision, start: int) -> PromptImage:
    processed = vision.processed(image)
    merge = vision.processor.merge_size
    span = ImageSpan(start, tuple(processed.grid_thw), merge)
    if span.num_tokens * merge ** 2 != processed.pixel_values.shape[0]:
        raise RequestError(f"messages: image {image.digest[:12]} gave {processed.pixel_values.shape[0]} patches "
                           f"for {span.num_tokens} tokens", param="messages")
    return PromptImage(span, image.digest, processed.pixel_values)
