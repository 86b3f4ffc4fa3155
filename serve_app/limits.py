"""Limits at the HTTP edge: the body's size, the request's sizes, and a stream whose client stops reading.

Past a limit the answer is a 4xx in OpenAI's error shape naming the field (docs/reliability.md, "Limits").
1. check_size_limits / check_generated_tokens: counts in a parsed request (stop strings, logit_bias entries,
   messages, content parts, n x max_tokens), each against its `ingress.*` cap.
2. BodyLimit: an ASGI middleware answering 413 in OpenAI's error shape past `max_body_bytes`: at once from
   Content-Length, else counting bytes as they arrive (chunked bodies), so no more than the limit is read.
3. BoundedStreamingResponse: an SSE response whose every write must finish within `stream_send_timeout_s`;
   past it the connection is closed and the body iterator closed, which aborts its replica calls
   (serve_app/fanout.py; the tokens it may hold meanwhile are bounded there by `max_buffered_tokens`).
"""

import asyncio
import json
import logging

from fastapi.responses import StreamingResponse

from core.app_config import IngressConfig
from core.messages import RequestError
from serve_app.protocol import ChatCompletionRequest, SamplingFields

logger = logging.getLogger(__name__)


def check_size_limits(body: SamplingFields, limits: IngressConfig) -> None:
    stop = body.stop_strings
    if len(stop) > limits.max_stop_strings:
        raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings; got {len(stop)}", param="stop")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise RequestError(f"stop: a stop string may have at most {limits.max_stop_string_chars} characters; "
                           f"got {longest}", param="stop")
    num_bias = len(body.logit_bias or {})
    if num_bias > limits.max_logit_bias:
        raise RequestError(f"logit_bias: at most {limits.max_logit_bias} entries; got {num_bias}",
                           param="logit_bias")
    if isinstance(body, ChatCompletionRequest):
        check_message_limits(body, limits)


def check_message_limits(body: ChatCompletionRequest, limits: IngressConfig) -> None:
    if len(body.messages) > limits.max_messages:
        raise RequestError(f"messages: at most {limits.max_messages} messages; got {len(body.messages)}",
                           param="messages")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list) and len(message.content) > limits.max_content_parts:
            param = f"messages[{i}].content"
            raise RequestError(f"{param}: at most {limits.max_content_parts} content parts; got "
                               f"{len(message.content)}", param=param)


def check_generated_tokens(body: SamplingFields, num_prompt: int, max_model_len: int, cap: int | None) -> None:
    """n x max_tokens (n x what the context leaves the prompt, max_tokens unset) within the deployment's cap."""
    num_per_choice = body.max_tokens or max_model_len - num_prompt
    if cap is not None and body.n * num_per_choice > cap:
        raise RequestError(f"max_tokens: n x max_tokens = {body.n} x {num_per_choice} exceeds this deployment's "
                           f"{cap} generated tokens per request", param="max_tokens")


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._refuse(send)
        num_received = 0
        is_too_large = False

        async def counted_receive():
            nonlocal num_received, is_too_large
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_bytes:
                    is_too_large = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            if not is_too_large:  # whatever the app makes of the exception, the answer is our 413
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        except Exception:
            if not is_too_large:
                raise
        if is_too_large:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        error = RequestError(f"the request body exceeds this deployment's {self.max_body_bytes} bytes "
                             "(ingress.max_body_bytes)", status_code=413, code="request_too_large")
        payload = json.dumps(error.to_body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]  # the rest of the body is never read
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class BoundedStreamingResponse(StreamingResponse):
    """A write that waits on a client not reading for more than `send_timeout_s` ends the response: the
    connection is closed (the server sees the app return mid-response) and the body iterator is closed."""

    def __init__(self, content, send_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send) -> None:
        async def send_in_time(message):
            await asyncio.wait_for(send(message), self.send_timeout_s)

        try:
            await super().stream_response(send_in_time)
        except asyncio.TimeoutError:
            logger.warning("a streaming client read nothing for %g s: the stream is cut", self.send_timeout_s)
        finally:
            await self.body_iterator.aclose()
