"""FanOut: n concurrent replica calls for one request, merged into one response or one SSE stream.

1. admit: one ingress replica holds at most `max_queued_requests` requests (waiting or
   streaming, whatever their n); past it, 429 with Retry-After.
2. call: n streaming calls, same prompt and routing hint (they land where the prompt is
   cached unless the load is imbalanced), each with its own request id and seed.
3. first deltas: every choice's first delta is awaited before answering, so an error
   before the first token is an HTTP error; after it, an SSE error event.
4. merge: choices indexed 0..n-1; streams interleaved chunk by chunk with their index;
   one usage (prompt counted once, completions summed); one `[DONE]`.
A client that goes away closes the merged stream, which cancels every call. A client that stops reading
holds at most `max_buffered_tokens` (over all choices, plus the one delta that crossed it) before every call
is aborted, and its connection is closed once one write has waited `stream_send_timeout_s`
(serve_app/limits.py).
"""

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse

from core.app_config import IngressConfig
from core.messages import GenerateDelta, GenerateRequest, RequestError, as_request_error
from serve_app.limits import BoundedStreamingResponse
from serve_app.metrics import IngressMetrics, TokenTimer
from serve_app.responses import ChoiceResult, ResponseFormat

REPLICA_HEADER = "x-tether-replica"


class FanOut:
    def __init__(self, backend, config: IngressConfig, metrics: IngressMetrics):
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.num_in_flight = 0
        self.last_delta_at = float("-inf")  # time.monotonic() of the last delta any replica sent

    async def respond(self, requests: list[GenerateRequest], fmt: ResponseFormat, stream: bool, start: float):
        """`start`: when the request arrived (time.perf_counter), for time to first token."""
        if self.num_in_flight >= self.config.max_queued_requests:
            raise RequestError("too many requests in flight; retry shortly", status_code=429,
                               type="rate_limit_exceeded")
        self.num_in_flight += 1
        streams = [self._timed(r, start) for r in requests]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams))
        except BaseException as exc:
            await self._close(streams)
            error = as_request_error(exc)
            if error is not None and error.param == "prompt":
                error.param = fmt.prompt_param  # the replica speaks of "prompt"; chat's field is "messages"
            raise error or exc
        headers = self._headers(firsts)
        if stream:
            return BoundedStreamingResponse(self.sse(fmt, firsts, streams), self.config.stream_send_timeout_s,
                                            media_type="text/event-stream", headers=headers)
        try:
            choices = await asyncio.gather(*(self._gather(i, f, s) for i, (f, s) in enumerate(zip(firsts, streams))))
        finally:
            await self._close(streams)
        self._count_tokens([c.last for c in choices])
        return JSONResponse(fmt.body(choices), headers=headers)

    async def _timed(self, request: GenerateRequest, start: float) -> AsyncIterator[GenerateDelta]:
        """One replica call, its deltas timed; closing it cancels the call."""
        timer = TokenTimer(self.metrics, start)
        stream = self.backend.stream(request)
        try:
            async for delta in stream:
                timer.tick()
                self.last_delta_at = time.monotonic()  # a replica served: /health needs no probe now
                yield delta
        finally:
            await stream.aclose()

    def _count_tokens(self, lasts: list[GenerateDelta]) -> None:
        self.metrics.tokens(lasts[0].num_prompt_tokens, sum(d.num_generated_tokens for d in lasts))

    def _headers(self, firsts: list[GenerateDelta]) -> dict:
        if not self.config.expose_replica_header:
            return {}
        return {REPLICA_HEADER: ",".join(dict.fromkeys(d.replica_id for d in firsts))}

    async def _close(self, streams) -> None:
        self.num_in_flight -= 1
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

    @staticmethod
    async def _gather(index: int, first: GenerateDelta, stream) -> ChoiceResult:
        choice = ChoiceResult(index)
        choice.add(first)
        async for delta in stream:
            choice.add(delta)
        return choice

    async def sse(self, fmt: ResponseFormat, firsts: list[GenerateDelta], streams) -> AsyncIterator[str]:
        lasts = list(firsts)
        try:
            for i, first in enumerate(firsts):
                yield _event(fmt.chunk(first, i, first=True))
            async for i, delta in _interleave(streams, self.config.max_buffered_tokens):
                lasts[i] = delta
                if delta.text or delta.finish_reason or fmt.return_token_ids or delta.logprobs:
                    chunk = fmt.chunk(delta, i)
                    if chunk is not None:  # a split reply holds back a tag that may still be arriving
                        yield _event(chunk)
            if fmt.include_usage:
                yield _event(fmt.usage_chunk(lasts))
            self._count_tokens(lasts)
        except Exception as exc:
            error = as_request_error(exc) or RequestError(f"generation failed: {exc}", status_code=500,
                                                          type="internal_error")
            yield _event(error.to_body())
        finally:
            await self._close(streams)
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _interleave(streams, max_buffered_tokens: int) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(choice index, delta) in arrival order, until every stream ends; an error in one ends all. Past
    `max_buffered_tokens` pulled and not yet taken (the sender is stuck on a client not reading), every
    call is aborted and the taker gets an error after what was buffered."""
    queue: asyncio.Queue = asyncio.Queue()
    num_buffered_tokens = 0

    async def pump(index: int, stream) -> None:
        nonlocal num_buffered_tokens
        try:
            async for delta in stream:
                num_buffered_tokens += len(delta.token_ids)
                await queue.put((index, delta))
                if num_buffered_tokens > max_buffered_tokens:  # abort every call now, not when the taker wakes
                    await queue.put((index, _read_too_slowly(max_buffered_tokens)))
                    for task in tasks:
                        if task is not asyncio.current_task():
                            task.cancel()
                    await stream.aclose()
                    return
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                num_buffered_tokens -= len(item.token_ids)
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _read_too_slowly(max_buffered_tokens: int) -> RequestError:
    return RequestError(f"the client read too slowly: more than {max_buffered_tokens} generated tokens waited "
                        "to be sent (ingress.max_buffered_tokens); generation was stopped", status_code=408,
                        type="timeout_error")
