"""Dispatcher: sends one GenerateRequest to a replica and turns its deltas into a response or an SSE stream.

Bounded: one ingress replica holds at most `max_queued_requests` requests
(waiting or streaming); past it, 429 with Retry-After. An error before the
first delta is an HTTP error; after it, an SSE error event. A client that goes
away closes the delta stream, which cancels the call and frees its sequence.
"""

import json
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from replicas.messages import GenerateDelta, GenerateRequest, RequestError, as_request_error
from serve_app.config import IngressConfig
from serve_app.responses import ResponseFormat

REPLICA_HEADER = "x-tether-replica"


class Dispatcher:
    def __init__(self, backend, config: IngressConfig):
        self.backend = backend
        self.config = config
        self.num_in_flight = 0

    async def respond(self, request: GenerateRequest, fmt: ResponseFormat, stream: bool):
        if self.num_in_flight >= self.config.max_queued_requests:
            raise RequestError("too many requests in flight; retry shortly", status_code=429,
                               type="rate_limit_exceeded")
        self.num_in_flight += 1
        deltas = self.backend.stream(request)
        try:
            first = await anext(deltas)  # errors before the first token become HTTP errors
        except BaseException as exc:
            self.num_in_flight -= 1
            await deltas.aclose()
            error = as_request_error(exc)
            if error is not None and error.param == "prompt":
                error.param = fmt.prompt_param  # the replica speaks of "prompt"; chat's field is "messages"
            raise error or exc
        headers = {REPLICA_HEADER: first.replica_id} if self.config.expose_replica_header else {}
        if stream:
            return StreamingResponse(self.sse(fmt, first, deltas), media_type="text/event-stream", headers=headers)
        try:
            text, token_ids, last = first.text, list(first.token_ids), first
            async for delta in deltas:
                text, last = text + delta.text, delta
                token_ids += delta.token_ids
        finally:
            self.num_in_flight -= 1
            await deltas.aclose()
        return JSONResponse(fmt.body(text, token_ids, first.prompt_token_ids, last), headers=headers)

    async def sse(self, fmt: ResponseFormat, first: GenerateDelta,
                  deltas: AsyncIterator[GenerateDelta]) -> AsyncIterator[str]:
        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            last = first
            yield event(fmt.chunk(first, first=True))
            async for delta in deltas:
                last = delta
                if delta.text or delta.finish_reason or fmt.return_token_ids:
                    yield event(fmt.chunk(delta))
            if fmt.include_usage:
                yield event(fmt.usage_chunk(last))
        except Exception as exc:
            error = as_request_error(exc) or RequestError(f"generation failed: {exc}", status_code=500,
                                                          type="internal_error")
            yield event(error.to_body())
        finally:
            self.num_in_flight -= 1
            await deltas.aclose()
        yield "data: [DONE]\n\n"
