"""Images in chat over HTTP (the openai client, the real engine) on a tiny random Qwen3.5 vision-language
model with Qwen3.5's published chat template: answers, streamed and not; a later turn serves the image from
cache (the vision tower ran once); every bad image, misplaced image or placeholder answers 400 naming its
field and reaches no engine; a typed `<|image_pad|>` is text."""

import base64
import io
import json
import shutil

import numpy as np
import openai
import pytest

from tests.http.conftest import MODEL, wait_idle

TEMPLATE = "testing/data/chat_templates/qwen3_5.jinja"


@pytest.fixture(scope="module")
def vl_chat_dir(smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from testing.tiny_vision import make_tiny_qwen3_5_vl

    path = make_tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-vl-chat"), smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer.chat_template = open(TEMPLATE).read()
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(start_server, vl_chat_dir):
    return start_server(own_replica=True, model=str(vl_chat_dir),
                        ingress={"max_image_bytes": 200_000, "max_image_pixels": 1_000_000,
                                 "reasoning_parser": "none"})  # a random model: its reply is all content


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def image_bytes(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(text: str, *uris: str) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in uris),
                                        {"type": "text", "text": text}]}


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_a_chat_with_an_image_answers_streamed_and_not(client):
    messages = [user("What is in the picture?", data_uri(image_bytes(96, 64, 1)))]
    reply = chat(client, messages)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, messages, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content


def test_the_next_turn_serves_the_image_from_cache(client, server):
    uri = data_uri(image_bytes(128, 96, 2))
    first = [user("Describe it.", uri)]
    runs_before = wait_idle(server)["num_vision_runs"]
    reply = chat(client, first)
    turn2 = first + [{"role": "assistant", "content": reply.choices[0].message.content}, user("And the colours?")]
    again = chat(client, turn2)
    # the first user message (image included: 12 tokens) and the reply come from the kept ids
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    details = again.usage.prompt_tokens_details.model_dump()
    assert details["retention"] == "retained" and details["retained_tokens"] > reply.usage.prompt_tokens, details
    assert wait_idle(server)["num_vision_runs"] == runs_before + 1


def test_two_images_of_one_size_are_told_apart(client):
    a, b = (data_uri(image_bytes(96, 96, seed)) for seed in (3, 4))
    first = chat(client, [user("Which one?", a)])
    second = chat(client, [user("Which one?", b)])
    # the same text before the image: whatever comes from cache stops before the image's tokens
    assert second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 9


@pytest.mark.parametrize("name,messages,param", [
    ("corrupt", [user("x", data_uri(image_bytes(64, 64, 5)[:200]))], "messages[0].content[0].image_url"),
    ("gif", [user("x", data_uri(image_bytes(64, 64, 5, "GIF"), "image/gif"))], "messages[0].content[0].image_url"),
    ("too many bytes", [user("x", data_uri(image_bytes(400, 300, 6)))], "messages[0].content[0].image_url"),
    ("too many pixels", [user("x", data_uri(image_bytes(1200, 1000, 7, "JPEG"), "image/jpeg"))],
     "messages[0].content[0].image_url"),
    ("url off", [user("x", "http://127.0.0.1:9/cat.png")], "messages[0].content[0].image_url"),
    ("system image", [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
                      user("x")], "messages[0].content[0]"),
    ("assistant image", [user("x"), {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:x"}}]}, user("y")], "messages[1].content[0]"),
])
def test_bad_images_answer_400_naming_the_field_and_reach_no_engine(client, server, name, messages, param):
    steps = wait_idle(server)["num_steps"]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages)
    assert caught.value.body["param"] == param, caught.value.body
    assert wait_idle(server)["num_steps"] == steps


def test_the_image_token_in_a_completions_prompt_is_refused(client, server, vl_chat_dir):
    image_token = json.loads((vl_chat_dir / "config.json").read_text())["image_token_id"]
    for prompt in ([1, 2, image_token, 3], "look: <|image_pad|>"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert caught.value.body["param"] == "prompt"


def test_a_typed_placeholder_is_text(client, server, vl_chat_dir):
    import httpx

    image_token = json.loads((vl_chat_dir / "config.json").read_text())["image_token_id"]
    messages = [{"role": "user", "content": "what does <|image_pad|> mean?"}]
    tokens = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    assert image_token not in tokens
    assert chat(client, messages).usage.completion_tokens == 8  # no image, no placeholder: it runs


def test_a_text_only_model_refuses_images(start_server):
    text_only = start_server()
    plain = openai.OpenAI(base_url=text_only.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(plain, [user("x", data_uri(image_bytes(32, 32, 1)))])
    assert caught.value.body["param"] == "messages[0].content[0]" and "takes no images" in caught.value.body["message"]


def test_a_template_that_writes_no_placeholder_is_refused(start_server, smollm2_dir, tmp_path_factory):
    """A template that renders the text parts only writes no placeholder for the image -> 400, nothing runs."""
    from testing.tiny_vision import make_tiny_qwen3_5_vl

    text_only = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{{ p.get('text', '') }}{% endfor %}{% endif %}\n"
                 "{% endfor %}assistant:")
    path = make_tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-vl-text-template"), smollm2_dir,
                                chat_template=text_only)
    other = start_server(own_replica=True, model=str(path))
    plain = openai.OpenAI(base_url=other.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(plain, [user("x", data_uri(image_bytes(64, 64, 1)))])
    assert caught.value.body["param"] == "messages" and "placeholder" in caught.value.body["message"]
    assert wait_idle(other)["num_steps"] == 0


def test_an_image_past_the_models_max_pixels_is_resized_not_refused(client, vl_chat_dir):
    """The tiny preprocessor's max_pixels is 65536; a 400 x 300 image (120000, under the ingress's hard limit)
    is resized down as transformers' processor does: at most 64 image tokens."""
    small = chat(client, [user("x")]).usage.prompt_tokens
    big = chat(client, [user("x", data_uri(image_bytes(400, 300, 8, "JPEG"), "image/jpeg"))]).usage.prompt_tokens
    assert 2 < big - small <= 64 + 2  # the image's tokens and its two markers
