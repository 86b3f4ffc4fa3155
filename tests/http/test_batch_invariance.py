"""engine.batch_invariant through the HTTP server (the openai client, SmolLM2, dtype auto as served): eight
concurrent clients -- six chat prompts among two others of other lengths -- get, for each of the six, the 64
greedy tokens and logprobs the engine gives that prompt alone (tests/conftest.py `alone_replies`), bit for bit."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from core.app_config import AppConfig
from replicas.device import resolve_dtype
from serve_app.local_server import LocalServer
from testing.invariance import OTHERS, PROMPTS

TOKENS = 64


@pytest.fixture(scope="module")
def client(smollm2_dir):
    import openai

    server = LocalServer(AppConfig(model=str(smollm2_dir), served_model_name="smollm2", dtype="auto"))
    try:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        server.stop()


def ask(client, text: str) -> list[tuple[int, float]]:
    """One chat turn, greedy: the reply's (token id, logprob) per token."""
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=TOKENS,
        logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = reply.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == TOKENS
    return list(zip(token_ids, [entry.logprob for entry in choice.logprobs.content]))


def test_eight_concurrent_clients_get_what_each_prompt_gets_alone(client, alone_replies):
    alone = alone_replies(str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."))
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda text: ask(client, text), PROMPTS + OTHERS[1:3]))[:len(PROMPTS)]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(alone, together)]
    assert firsts == [None] * len(PROMPTS), f"first differing token per prompt: {firsts}"
