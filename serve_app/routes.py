"""The OpenAI routes: validate -> render -> hint -> dispatch -> format.

`OpenAIServer` holds the logic and `make_api` binds it to FastAPI, so the same
routes run inside the Serve ingress and, over a LocalBackend, in plain uvicorn.
"""

import hashlib
import uuid

from fastapi import Depends, FastAPI, Request

from cache_router.hashing import route_key
from replicas.config import read_max_position_embeddings
from replicas.messages import GenerateRequest, RequestError, as_request_error
from replicas.models.prepare import prepare_model
from serve_app.config import AppConfig
from serve_app.dispatch import REPLICA_HEADER, Dispatcher
from serve_app.errors import error_response, install_error_handlers
from serve_app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                TokenizeRequest)
from serve_app.render import ChatRender, Renderer
from serve_app.responses import ResponseFormat

__all__ = ["OpenAIServer", "make_api", "REPLICA_HEADER", "VERSION"]
VERSION = "0.1.0"


class OpenAIServer:
    def __init__(self, config: AppConfig, renderer: Renderer, backend, max_model_len: int, block_size: int):
        self.config = config
        self.renderer = renderer
        self.backend = backend
        self.dispatcher = Dispatcher(backend, config.ingress)
        self.model_name = config.model_name()
        self.max_model_len = max_model_len
        self.block_size = block_size
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
        """Who asks, namespacing per-caller state: the API key, else `user`, else the deployment ("")."""
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
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

    def retains(self, body: ChatCompletionRequest) -> bool:
        """Retention is on by default; the deployment's switch wins over the request's."""
        return self.config.engine.retain_token_ids and body.retain_token_ids is not False

    async def chat(self, body: ChatCompletionRequest, key_identity: str | None):
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        await self.sync_limits()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        render = self.renderer.render_turn(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                           caller, self.model_name, self.retains(body))
        key = route_key(caller, self.model_name, messages=messages, block_size=self.block_size)
        request = self.generate_request(body, render.prompt_token_ids, caller, key, "messages")
        self._attach_retention(request, render)
        fmt = ResponseFormat("chat", f"chatcmpl-{request.request_id}", self.model_name, body.include_usage,
                             body.return_token_ids)
        return await self.dispatcher.respond(request, fmt, body.stream)

    def _attach_retention(self, request: GenerateRequest, render: ChatRender) -> None:
        request.history_key = render.history_key
        request.new_turn_span = render.new_turn_span
        request.conversation_key = render.conversation_key
        request.retention = render.retention
        if render.conversation_key is not None:
            request.turn_terminator_ids = self.renderer.turn_terminator()[1]

    async def completions(self, body: CompletionRequest, key_identity: str | None):
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        await self.sync_limits()
        ids = self.renderer.encode_prompt(body.prompt)
        key = route_key(caller, self.model_name, token_ids=ids, block_size=self.block_size,
                        num_route_blocks=self.config.router.num_route_blocks)
        request = self.generate_request(body, ids, caller, key, "prompt")
        fmt = ResponseFormat("completion", f"cmpl-{request.request_id}", self.model_name, body.include_usage,
                             body.return_token_ids)
        return await self.dispatcher.respond(request, fmt, body.stream)

    # -- token ids without generation ------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> dict:
        """With `messages`, the ids a chat generation's prompt would have with retention off."""
        self.check_model(body.model)
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = self.renderer.render_chat(messages, body.add_generation_prompt, body.chat_template_kwargs)
        elif isinstance(body.prompt, list):
            ids = list(body.prompt)
        else:
            ids = self.renderer.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = len(self.renderer.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.renderer.tokenizer.decode(body.tokens)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tether", "max_model_len": self.max_model_len}]}


def make_api(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="Tether", version=VERSION)
    install_error_handlers(app, server.config.ingress.retry_after_s)
    auth = Depends(server.authenticate)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, key: str | None = auth):
        return await server.chat(body, key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, key: str | None = auth):
        return await server.completions(body, key)

    for prefix in ("", "/v1"):  # vLLM serves these at the root; clients also look under /v1
        app.add_api_route(f"{prefix}/tokenize", server.tokenize, methods=["POST"], dependencies=[auth])
        app.add_api_route(f"{prefix}/detokenize", server.detokenize, methods=["POST"], dependencies=[auth])

    @app.get("/v1/models", dependencies=[auth])
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
