"""Chat images at the ingress (serve_app/images.py): data URIs and URLs loaded, checked, refused with a 400
naming the field."""

import asyncio
import base64
import hashlib
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image, ImageFile

from core.app_config import IngressConfig
from core.messages import RequestError
from serve_app.images import ImageLimits, image_parts, load_image, load_images
from serve_app.protocol import ChatMessage

PARAM = "messages[0].content[1].image_url"
URLS_ON = ImageLimits(allow_image_urls=True, max_image_bytes=200_000, image_fetch_timeout_s=0.5)


def encoded(fmt: str, size=(7, 5), color=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


def noise_png(size=(64, 64)) -> bytes:
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(url: str, limits=ImageLimits()):
    return asyncio.run(load_image(url, PARAM, limits))


def refusal(call, *args, param=PARAM) -> RequestError:
    with pytest.raises(RequestError) as err:
        result = call(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    assert err.value.status_code == 400
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}: ")
    return err.value


def user(*parts, role="user"):
    return {"role": role, "content": [{"type": "text", "text": "look"}, *parts]}


def image(url: str):
    return {"type": "image_url", "image_url": {"url": url}}


# data URIs

@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("JPEG", "image/jpg"),
                                      ("WEBP", "image/webp"), ("PNG", "image/jpeg")])  # a wrong mime is fine
def test_data_uri_images_load_with_their_size_and_digest(fmt, mime):
    data = encoded(fmt)
    loaded = load(data_uri(data, mime))
    assert (loaded.width, loaded.height) == (7, 5)
    assert loaded.data == data
    assert loaded.digest == hashlib.sha256(data).hexdigest()


def test_digest_is_the_identity_of_the_bytes():
    red, blue = encoded("PNG", color=(255, 0, 0)), encoded("PNG", color=(0, 0, 255))
    assert load(data_uri(red)).digest == load(data_uri(red)).digest
    assert load(data_uri(red)).digest != load(data_uri(blue)).digest


def test_truncated_png_is_corrupt():
    data = noise_png()
    assert "corrupt image" in refusal(load, data_uri(data[: len(data) // 2])).message


def test_gif_is_an_unsupported_format():
    message = refusal(load, data_uri(encoded("GIF"), "image/gif")).message
    assert "unsupported image format GIF; send PNG, JPEG or WebP" in message


def test_bytes_that_are_no_image_are_refused():
    assert "not an image" in refusal(load, data_uri(b"hello, not an image")).message


@pytest.mark.parametrize("url,words", [("data:image/png;base64,@@not base64@@", "not valid base64"),
                                       ("data:image/png;base64,abcde", "not valid base64"),
                                       ("data:image/png,rawbytes", "must be base64"),
                                       ("data:text/plain;base64,aGk=", "expected a data URI"),
                                       ("data:image/png;base64", "expected a data URI")])
def test_malformed_data_uris_are_refused(url, words):
    assert words in refusal(load, url).message


def test_base64_with_line_breaks_loads():
    data = encoded("PNG")
    text = base64.encodebytes(data).decode()  # a newline every 76 characters
    assert load(f"data:image/png;base64,{text}").data == data


def test_bytes_past_the_limit_are_refused():
    data = noise_png()
    assert load(data_uri(data), ImageLimits(max_image_bytes=len(data))).data == data
    for max_bytes in (len(data) - 1, len(data) // 2):  # just over: after decoding; far over: before
        message = refusal(load, data_uri(data), ImageLimits(max_image_bytes=max_bytes)).message
        assert "ingress.max_image_bytes" in message


def test_pixels_past_the_limit_are_refused_before_decoding(monkeypatch):
    data = encoded("PNG", size=(101, 100))
    limits = ImageLimits(max_image_pixels=10_000)

    def decoded(self):
        raise AssertionError("decoded an image over the pixel limit")
    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
    message = refusal(load, data_uri(data), limits).message
    assert "101x100 = 10100 pixels" in message and "ingress.max_image_pixels" in message


def png_header_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_header_claiming_a_huge_size_is_refused_before_decoding():
    data = png_header_claiming(100_000, 100_000)  # past Pillow's own decompression-bomb limit too
    assert "ingress.max_image_pixels" in refusal(load, data_uri(data)).message
    data = png_header_claiming(8_000, 8_000)  # 64M: under Pillow's limit, over ours
    assert "8000x8000 = 64000000 pixels" in refusal(load, data_uri(data)).message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "just-a-name.png"])
def test_other_schemes_are_refused(url):
    assert "data: URI" in refusal(load, url).message


# URLs

def test_urls_are_refused_when_off():
    message = refusal(load, "http://127.0.0.1:9/a.png").message
    assert "image URLs are off on this deployment (ingress.allow_image_urls)" in message


class ImageServer(BaseHTTPRequestHandler):
    png = encoded("PNG", size=(9, 4))
    big_chunk = b"\0" * 65536
    num_big_chunks = 1024  # 64 MiB unless the client stops reading
    sent = {}

    def do_GET(self):
        if self.path == "/ok.png":
            self._reply(200, self.png)
        elif self.path == "/slow.png":
            time.sleep(2)
            self._reply(200, self.png)
        elif self.path == "/declared-big.png":
            self._reply(200, self.png, length=10**9)
        elif self.path == "/big.png":
            self._stream_big()
        else:
            self._reply(404, b"no such image")

    def _reply(self, status: int, body: bytes, length: int | None = None):
        self.send_response(status)
        self.send_header("Content-Length", str(length or len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream_big(self):
        # No Content-Length: the body ends when the connection closes, so only the reader's cap stops it.
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        num_sent = 0
        try:
            for _ in range(self.num_big_chunks):
                self.wfile.write(self.big_chunk)
                num_sent += len(self.big_chunk)
        except OSError:
            pass
        self.sent["big"] = num_sent

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetched_image_loads(server_url):
    loaded = load(f"{server_url}/ok.png", URLS_ON)
    assert (loaded.width, loaded.height) == (9, 4)
    assert loaded.digest == hashlib.sha256(ImageServer.png).hexdigest()


def test_fetch_answering_404_is_refused(server_url):
    assert "HTTP 404" in refusal(load, f"{server_url}/missing.png", URLS_ON).message


def test_fetch_past_the_byte_limit_stops_reading(server_url):
    assert "ingress.max_image_bytes" in refusal(load, f"{server_url}/declared-big.png", URLS_ON).message
    assert "ingress.max_image_bytes" in refusal(load, f"{server_url}/big.png", URLS_ON).message
    deadline = time.monotonic() + 5
    while "big" not in ImageServer.sent and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ImageServer.sent["big"] < ImageServer.num_big_chunks * len(ImageServer.big_chunk)


def test_fetch_past_the_timeout_is_refused(server_url):
    started = time.monotonic()
    assert "ingress.image_fetch_timeout_s" in refusal(load, f"{server_url}/slow.png", URLS_ON).message
    assert time.monotonic() - started < 1.5


def test_fetch_from_nowhere_is_refused(server_url):
    closed = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    port = closed.server_address[1]
    closed.server_close()
    assert "could not fetch the image" in refusal(load, f"http://127.0.0.1:{port}/a.png", URLS_ON).message


# messages

def test_image_parts_are_found_in_order_with_their_field():
    png = data_uri(encoded("PNG"))
    messages = [{"role": "system", "content": "be brief"}, user(image(png)),
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [image(png), {"type": "image_url", "image_url": png}]}]
    parts = image_parts(messages, ImageLimits())
    assert [part.param for part in parts] == ["messages[1].content[1].image_url",
                                              "messages[3].content[0].image_url",
                                              "messages[3].content[1].image_url"]
    assert image_parts([ChatMessage(**message) for message in messages], ImageLimits()) == parts
    assert image_parts([{"role": "user", "content": "hi"}], ImageLimits()) == []


@pytest.mark.parametrize("role", ["system", "developer", "assistant", "tool"])
def test_images_outside_user_messages_are_refused(role):
    messages = [{"role": "user", "content": "hi"}, user(image(data_uri(encoded("PNG"))), role=role)]
    message = refusal(image_parts, messages, ImageLimits(), param="messages[1].content[1]").message
    assert "images are accepted in user messages only" in message


def test_more_images_than_the_limit_are_refused():
    png = data_uri(encoded("PNG"))
    messages = [user(*[image(png)] * 3)]
    assert len(image_parts(messages, ImageLimits(max_images_per_request=3))) == 3
    message = refusal(image_parts, messages, ImageLimits(max_images_per_request=2), param="messages").message
    assert "ingress.max_images_per_request" in message


@pytest.mark.parametrize("part", [{"type": "image_url"}, {"type": "image_url", "image_url": {"url": ""}},
                                  {"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}])
def test_malformed_image_parts_are_refused(part):
    refusal(image_parts, [user(part)], ImageLimits(), param="messages[0].content[1].image_url")


def test_load_images_keeps_request_order():
    sizes = [(3, 2), (5, 4), (2, 7)]
    messages = [user(*[image(data_uri(encoded("PNG", size=size))) for size in sizes])]
    loaded = asyncio.run(load_images(messages, ImageLimits()))
    assert [(image.width, image.height) for image in loaded] == sizes


def test_load_images_refuses_the_bad_image_naming_it():
    messages = [user(image(data_uri(encoded("PNG"))), image(data_uri(encoded("GIF"))))]
    refusal(load_images, messages, ImageLimits(), param="messages[0].content[2].image_url")


def test_limits_come_from_the_ingress_config():
    assert ImageLimits.from_config(IngressConfig()) == ImageLimits()
    limits = ImageLimits.from_config(IngressConfig(allow_image_urls=True, max_image_pixels=1000))
    assert limits.allow_image_urls and limits.max_image_pixels == 1000
