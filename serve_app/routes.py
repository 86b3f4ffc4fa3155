"""The OpenAI routes: validate -> render -> hint -> dispatch -> format.

`OpenAIServer` holds the logic and `make_api` binds it to FastAPI, so the same
routes run inside the Serve ingress and, over a LocalBackend, in plain uvicorn.
"""

import hashlib
import json
import uuid
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cache_router.hashing import route_key
from replicas.config import read_max_position_embeddings
from replicas.messages import GenerateDelta, GenerateRequest, RequestError, as_request_error
from replicas.models.prepare import prepare_model
from serve_app.config import AppConfig
from serve_app.errors import error_response, install_error_handlers
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from serve_app.render import Renderer
from serve_app.responses import ResponseFormat

REPLICA_HEADER = "x-tether-replica"
VERSION = "0.1.0"


class OpenAIServer:
    def __init__(self, config: AppConfig, renderer: Renderer, backend, max_model_len: int, block_size: int):
        self.config = config
        self.renderer = renderer
        self.backend = backend
        self.model_name = config.model_name()
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_in_flight = 0
        self._asked_replicas = False

    @classmethod
    def from_config(cls, config: AppConfig, backend) -> "OpenAIServer":
        """Prepares (or finds) the model on this node and reads what the ingress checks before dispatch."""
        model_dir = str(prepare_model(config.model, progress=False))
        engine = config.engine
        # The replicas cap this further by their KV pool and re-check; this is the early, cheap check.
        model_len = engine.context_len(read_max_position_embeddings(model_dir))
        return cls(config, Renderer(model_dir), backend, max_model_len=model_len, block_size=engine.block_size)

    # -- steps 1-3: who asks, what they asked for, where it goes ---------------

    def authenticate(self, http: Request) -> str | None:
        """A FastAPI dependency, so a bad key answers 401 before the body is even validated.
        Returns the caller's key identity (a digest, never the key), or None without auth."""
        keys = self.config.ingress.api_keys
        if not keys:
            return None
        auth = http.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if token not in keys:
            raise RequestError("invalid or missing API key", status_code=401, type="authentication_error",
                               code="invalid_api_key")
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]

    @staticmethod
    def caller(key_identity: str | None, user: str | None) -> str:
        """Who asks, namespacing per-caller state: the API key, else `user`, else nobody in particular."""
        if key_identity:
            return key_identity
        return f"user:{user}" if user else ""

    async def sync_limits(self) -> None:
        """Once: take the replicas' context length, which their KV pool may cap below the model's."""
        if self._asked_replicas:
            return
        try:
            info = await self.backend.model_info()
        except Exception:  # replicas not up yet: keep the static limit, ask again next time
            return
        self.max_model_len = min(self.max_model_len, info["max_model_len"])
        self._asked_replicas = True

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                               status_code=404, param="model", code="model_not_found")

    def generate_request(self, body: SamplingFields, prompt_token_ids: list[int], caller: str, key: str,
                         prompt_param: str) -> GenerateRequest:
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the "
                               f"prompt has {num_prompt}.", param=prompt_param, code="context_length_exceeded")
        if body.max_tokens is not None and num_prompt + body.max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; {num_prompt} "
                               f"in the prompt + {body.max_tokens} max_tokens exceed it.", param="max_tokens",
                               code="context_length_exceeded")
        return GenerateRequest(uuid.uuid4().hex, prompt_token_ids, body.sampling_params(), caller=caller,
                               route_key=key)

    async def chat(self, body: ChatCompletionRequest, key_identity: str | None):
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        await self.sync_limits()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = self.renderer.render_chat(messages, body.add_generation_prompt, body.chat_template_kwargs)
        key = route_key(caller, self.model_name, messages=messages, block_size=self.block_size)
        request = self.generate_request(body, ids, caller, key, "messages")
        fmt = ResponseFormat("chat", f"chatcmpl-{request.request_id}", self.model_name)
        return await self.respond(request, fmt, body.stream, body.include_usage)

    async def completions(self, body: CompletionRequest, key_identity: str | None):
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        await self.sync_limits()
        ids = self.renderer.encode_prompt(body.prompt)
        key = route_key(caller, self.model_name, token_ids=ids, block_size=self.block_size,
                        num_route_blocks=self.config.router.num_route_blocks)
        request = self.generate_request(body, ids, caller, key, "prompt")
        fmt = ResponseFormat("completion", f"cmpl-{request.request_id}", self.model_name)
        return await self.respond(request, fmt, body.stream, body.include_usage)

    # -- steps 4 and the last: dispatch, format --------------------------------

    async def respond(self, request: GenerateRequest, fmt: ResponseFormat, stream: bool, include_usage: bool):
        ingress = self.config.ingress
        if self.num_in_flight >= ingress.max_queued_requests:
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
        headers = {REPLICA_HEADER: first.replica_id} if ingress.expose_replica_header else {}
        if stream:
            return StreamingResponse(self.sse(fmt, first, deltas, include_usage), media_type="text/event-stream",
                                     headers=headers)
        try:
            text, last = first.text, first
            async for delta in deltas:
                text, last = text + delta.text, delta
        finally:
            self.num_in_flight -= 1
            await deltas.aclose()
        return JSONResponse(fmt.body(text, last), headers=headers)

    async def sse(self, fmt: ResponseFormat, first: GenerateDelta, deltas: AsyncIterator[GenerateDelta],
                  include_usage: bool) -> AsyncIterator[str]:
        def event(payload: dict) -> str:
            if include_usage and "usage" not in payload and "error" not in payload:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        try:
            last = first
            if fmt.kind == "chat":
                yield event(fmt.chunk("", None, first=True))
            if first.text or first.finish_reason:
                yield event(fmt.chunk(first.text, first.finish_reason))
            async for delta in deltas:
                last = delta
                if delta.text or delta.finish_reason:
                    yield event(fmt.chunk(delta.text, delta.finish_reason))
            if include_usage:
                yield event(fmt.usage_chunk(last))
        except Exception as exc:
            error = as_request_error(exc) or RequestError(f"generation failed: {exc}", status_code=500,
                                                          type="internal_error")
            yield event(error.to_body())
        finally:
            self.num_in_flight -= 1
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    # -- token ids without generation ------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tether", "max_model_len": self.max_model_len}]}


def make_api(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="Tether", version=VERSION)
    install_error_handlers(app, server.config.ingress.retry_after_s)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, key: str | None = Depends(server.authenticate)):
        return await server.chat(body, key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, key: str | None = Depends(server.authenticate)):
        return await server.completions(body, key)

    @app.get("/v1/models", dependencies=[Depends(server.authenticate)])
    async def models():
        await server.sync_limits()
        return server.models()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        error = as_request_error(exc) or RequestError(f"internal error: {exc}", status_code=500,
                                                      type="internal_error")
        return error_response(error, server.config.ingress.retry_after_s)

    return app
