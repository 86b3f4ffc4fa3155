"""Images in chat requests: the `image_url` content parts, found, loaded and checked at the ingress.

The ingress decodes each image once, only to refuse what the replica could not use (a format other
than PNG, JPEG or WebP, a corrupt file, too many pixels) with a 400 naming the field. The replica
receives the encoded bytes (core.messages.ImageInput) and resizes them to its model's size.
Pillow runs in a worker thread: decoding a large image must not stall the event loop.
"""

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import io
from dataclasses import dataclass

import aiohttp
from PIL import Image

from core.app_config import IngressConfig
from core.messages import ImageInput, RequestError

FORMATS = ("PNG", "JPEG", "WEBP")  # PIL format names
DETAILS = (None, "auto", "low", "high")
FETCH_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one chat request's images may be; the defaults are IngressConfig's."""
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000  # past it: 400; between the model's size and this the replica resizes
    max_images_per_request: int = 16
    allow_image_urls: bool = False
    image_fetch_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, ingress: IngressConfig) -> "ImageLimits":
        return cls(**{field.name: getattr(ingress, field.name) for field in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One `image_url` content part and the request field it came from."""
    url: str
    param: str  # messages[i].content[j].image_url
    detail: str | None = None


def _field(message, name: str):
    # Messages come as dicts (the request JSON) or as protocol.ChatMessage models.
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def image_parts(messages, limits: ImageLimits) -> list[ImagePart]:
    """The image parts of chat `messages`, in request order. Images are accepted in user messages
    only, and at most `limits.max_images_per_request` of them; otherwise a RequestError (400)."""
    parts = []
    for i, message in enumerate(messages):
        content = _field(message, "content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                parts.append(_image_part(part, f"messages[{i}].content[{j}]", _field(message, "role")))
    if len(parts) > limits.max_images_per_request:
        raise RequestError(f"messages: {len(parts)} images in the request; the limit is "
                           f"{limits.max_images_per_request} (ingress.max_images_per_request)", param="messages")
    return parts


def _image_part(part: dict, param: str, role: str) -> ImagePart:
    if role != "user":
        raise RequestError(f"{param}: images are accepted in user messages only (this is a {role} message)",
                           param=param)
    param = f"{param}.image_url"
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the URL bare
        url, detail = image_url, None
    elif isinstance(image_url, dict):
        url, detail = image_url.get("url"), image_url.get("detail")
    else:
        url = detail = None
    if not isinstance(url, str) or not url:
        raise RequestError(f"{param}: an image_url part needs image_url.url", param=param)
    if detail not in DETAILS:
        raise RequestError(f"{param}: detail must be 'auto', 'low' or 'high', not {detail!r}", param=param)
    return ImagePart(url, param, detail)


async def load_images(messages, limits: ImageLimits) -> list[ImageInput]:
    """Every image of chat `messages`, loaded concurrently and checked, in request order.
    The first failure cancels the rest and is raised."""
    parts = image_parts(messages, limits)
    tasks = [asyncio.ensure_future(load_image(part.url, part.param, limits)) for part in parts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def load_image(url: str, param: str, limits: ImageLimits) -> ImageInput:
    """One image from a base64 `data:` URI or, when the deployment allows it, an http(s) URL, checked.
    Every refusal is a RequestError (400) with `param`."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        data = await asyncio.to_thread(_decode_data_uri, url, param, limits.max_image_bytes)
    elif scheme in ("http", "https"):
        data = await _fetch(url, param, limits)
    else:
        raise RequestError(f"{param}: an image URL must be a data: URI (base64) or an http(s) URL, "
                           f"not {scheme[:16] + ':' if scheme else 'a bare string'}", param=param)
    return await asyncio.to_thread(_checked_image, data, param, limits.max_image_pixels)


def _too_many_bytes(param: str, num_bytes: str, max_bytes: int) -> RequestError:
    return RequestError(f"{param}: the image is {num_bytes} bytes; the limit is {max_bytes} "
                        f"(ingress.max_image_bytes)", param=param)


def _decode_data_uri(url: str, param: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    media_type, *options = header[len("data:"):].split(";")
    if not comma or not media_type.strip().lower().startswith("image/"):
        raise RequestError(f"{param}: expected a data URI like data:image/png;base64,<data>", param=param)
    if "base64" not in (option.strip().lower() for option in options):
        raise RequestError(f"{param}: image data URIs must be base64 (data:image/png;base64,<data>)", param=param)
    payload = "".join(payload.split())
    if len(payload) > 4 * (max_bytes // 3 + 1):  # refused before decoding
        raise _too_many_bytes(param, f"over {max_bytes}", max_bytes)
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{param}: the data URI's payload is not valid base64", param=param) from None
    if len(data) > max_bytes:
        raise _too_many_bytes(param, str(len(data)), max_bytes)
    return data


async def _fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    if not limits.allow_image_urls:
        raise RequestError(f"{param}: image URLs are off on this deployment (ingress.allow_image_urls); "
                           f"send the image as a data: URI", param=param)
    timeout = aiohttp.ClientTimeout(total=limits.image_fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise RequestError(f"{param}: fetching the image answered HTTP {response.status}", param=param)
            return await _read_capped(response, param, limits.max_image_bytes)
    except asyncio.TimeoutError:  # TimeoutError on 3.11+; aiohttp's ServerTimeoutError too
        raise RequestError(f"{param}: fetching the image took over {limits.image_fetch_timeout_s}s "
                           f"(ingress.image_fetch_timeout_s)", param=param) from None
    except (aiohttp.ClientError, ValueError) as exc:
        raise RequestError(f"{param}: could not fetch the image: {type(exc).__name__}: {exc}",
                           param=param) from None


async def _read_capped(response: aiohttp.ClientResponse, param: str, max_bytes: int) -> bytes:
    """The body, read no further than `max_bytes` (a larger one closes the connection)."""
    if response.content_length is not None and response.content_length > max_bytes:
        raise _too_many_bytes(param, str(response.content_length), max_bytes)
    chunks, num_bytes = [], 0
    async for chunk in response.content.iter_chunked(FETCH_CHUNK_BYTES):
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            response.close()
            raise _too_many_bytes(param, f"over {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _checked_image(data: bytes, param: str, max_pixels: int) -> ImageInput:
    """Open (header only), check the format and the pixel count, then decode fully to find corrupt data."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own limit, when it is below ours
        raise _too_many_pixels(param, "too many", max_pixels) from None
    except Exception:
        raise RequestError(f"{param}: not an image Tether can read; send PNG, JPEG or WebP", param=param) from None
    with image:
        if image.format not in FORMATS:
            raise RequestError(f"{param}: unsupported image format {image.format}; send PNG, JPEG or WebP",
                               param=param)
        width, height = image.size
        if width * height > max_pixels:
            raise _too_many_pixels(param, f"{width}x{height} = {width * height}", max_pixels)
        try:
            image.load()
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, "too many", max_pixels) from None
        except Exception as exc:
            raise RequestError(f"{param}: corrupt image: {exc}", param=param) from None
    return ImageInput(data, width, height, hashlib.sha256(data).hexdigest())


def _too_many_pixels(param: str, num_pixels: str, max_pixels: int) -> RequestError:
    return RequestError(f"{param}: the image has {num_pixels} pixels; the limit is {max_pixels} "
                        f"(ingress.max_image_pixels)", param=param)


def mark_images(messages: list[dict], images: list[ImageInput]) -> None:
    """Gives each {"type": "image"} part of the template's messages (protocol.ChatMessage.for_template) its
    image's digest, in order: the template ignores it; the conversation and routing keys hash it, so two
    conversations that differ only in an image never share kept ids or a route."""
    queue = iter(images)
    for message in messages:
        for part in message.get("content") if isinstance(message.get("content"), list) else []:
            if part.get("type") == "image":
                part["image_digest"] = next(queue).digest
