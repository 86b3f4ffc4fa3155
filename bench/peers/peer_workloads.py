"""The workloads bench/peers/peers.py runs against every system, through the openai client, streaming, greedy."""

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import openai

from bench.common import QUESTIONS, TOPICS, percentile, user_turn
from model_files.prepare import prepare_model

DECODE_TOKENS = 128
STREAMS = 8
LONG_PROMPT_TOKENS, SHORT_PROMPT_TOKENS = 1000, 100
TURNS, REPLY_TOKENS, LATE_TURNS = 8, 32, slice(5, 8)


@dataclass
class Reply:
    text: str
    ttft_s: float  # request sent -> first content chunk
    decode_s: float  # first -> last content chunk
    total_s: float
    tokens: int  # completion tokens: usage, else max_tokens on finish_reason "length", else content chunks
    prompt_tokens: int | None
    cached_tokens: int | None  # None: not reported
    gaps_s: list[float]  # between consecutive content chunks


def stream_chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int, extra: dict) -> Reply:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    text, stamps, usage, finish_reason = [], [], None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.choices:
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        usage = chunk.usage or usage
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError("the server streamed no content")
    if usage:
        tokens = usage.completion_tokens
    else:
        tokens = max_tokens if finish_reason == "length" else len(stamps)
    details = usage and usage.prompt_tokens_details
    return Reply("".join(text), stamps[0] - start, stamps[-1] - stamps[0], end - start, tokens,
                 usage and usage.prompt_tokens, details.cached_tokens if details else None,
                 [b - a for a, b in zip(stamps, stamps[1:])])


@dataclass
class Workbench:
    client: openai.OpenAI
    model: str
    body: Callable[[int | None], dict]
    long_prompts: Callable[[str, int], str]  # nonce, tokens -> a user message of that size that starts with it
    # Tether only: the engine's latest (deltas, seconds) steps, cleared on reading: its own pace.
    engine_steps: Callable[[], list[tuple[int, float]]] | None = None

    def chat(self, messages: list[dict], max_tokens: int, fixed_length: bool = True) -> Reply:
        return stream_chat(self.client, self.model, messages, max_tokens,
                           self.body(max_tokens if fixed_length else None))


def decode_1(bench: Workbench, rep: int) -> dict:
    reply = bench.chat([{"role": "user", "content": QUESTIONS[rep % len(QUESTIONS)]}], DECODE_TOKENS)
    return {"tok_s": (reply.tokens - 1) / reply.decode_s, "e2e_s": reply.total_s, "tokens": reply.tokens}


def decode_8(bench: Workbench, rep: int) -> dict:
    prompts = [[{"role": "user", "content": QUESTIONS[(rep + i) % len(QUESTIONS)]}] for i in range(STREAMS)]
    if bench.engine_steps:
        bench.engine_steps()
    with ThreadPoolExecutor(STREAMS) as pool:
        start = time.perf_counter()
        replies = list(pool.map(lambda messages: bench.chat(messages, DECODE_TOKENS), prompts))
        wall = time.perf_counter() - start
    tokens = sum(reply.tokens for reply in replies)
    gaps = [gap for reply in replies for gap in reply.gaps_s]
    run = {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "gap_p99_s": percentile(gaps, 0.99)}
    if bench.engine_steps:  # the steps that decoded all the streams at once
        full = [seconds for deltas, seconds in bench.engine_steps() if deltas == STREAMS]
        run["step_p99_s"] = percentile(full, 0.99) if full else None
    return run


def cold_ttft(bench: Workbench, rep: int, prompt_tokens: int) -> dict:
    nonce = f"Request {rep}-{time.time_ns()}."  # first in the prompt: nothing cached helps
    reply = bench.chat([{"role": "system", "content": nonce},
                        {"role": "user", "content": bench.long_prompts(nonce, prompt_tokens)}], 8)
    return {"ttft_s": reply.ttft_s, "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens}


def chat_8(bench: Workbench, rep: int) -> dict:
    messages, turns = [], []
    for k in range(TURNS):
        messages.append({"role": "user", "content": user_turn(rep, k)})
        reply = bench.chat(messages, REPLY_TOKENS, fixed_length=False)
        messages.append({"role": "assistant", "content": reply.text})
        turns.append({"ttft_s": reply.ttft_s, "prompt_tokens": reply.prompt_tokens,
                      "cached_tokens": reply.cached_tokens, "completion_tokens": reply.tokens})
    late = turns[LATE_TURNS]
    return {"turn1_ttft_s": turns[0]["ttft_s"], "late_ttft_s": statistics.median(t["ttft_s"] for t in late),
            "turn1_cached": turns[0]["cached_tokens"], "late_cached": median_or_none(t["cached_tokens"] for t in late),
            "last_prompt_tokens": turns[-1]["prompt_tokens"], "turns": turns}


def ttft_1k(bench: Workbench, rep: int) -> dict:
    return cold_ttft(bench, rep, LONG_PROMPT_TOKENS)


def ttft_100(bench: Workbench, rep: int) -> dict:
    return cold_ttft(bench, rep, SHORT_PROMPT_TOKENS)


WORKLOADS = {"decode-1": decode_1, "decode-8": decode_8, "ttft-1k": ttft_1k, "ttft-100": ttft_100, "chat-8": chat_8}


def long_prompt_builder() -> Callable[[str, int], str]:
    """nonce, tokens -> nonce + filler sentences, up to that many tokens (counted with the model's tokenizer)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(prepare_model("default", progress=False) / "tokenizer.json"))
    sentences = [f"Note {i}: the {TOPICS[i % len(TOPICS)]} in region {i * 7 % 31} were surveyed in year "
                 f"{1900 + i * 3}, and the report lists their size, age, access roads and visitor numbers."
                 for i in range(200)]

    def build(nonce: str, tokens: int) -> str:
        text = nonce
        for sentence in sentences:
            if len(tokenizer.encode(text + " " + sentence).ids) > tokens:
                break
            text += " " + sentence
        return text + " Summarize these notes."

    return build


def median_or_none(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else statistics.median(values)
