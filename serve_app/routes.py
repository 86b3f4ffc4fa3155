"""The OpenAI routes: validate -> render -> hint -> dispatch -> format.

`OpenAIServer` holds the logic and `make_api` binds it to FastAPI, so the same
routes run inside the Serve ingress and, over a LocalBackend, in plain uvicorn.
"""

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from typing import Sequence

from fastapi import Depends, FastAPI, Request

from core.app_config import AppConfig
from core.engine_config import read_max_position_embeddings
from core.hashing import route_key
from core.messages import GenerateRequest, ImageInput, RequestError, StructuredSpec, as_request_error
from model_files.prepare import prepare_model
from serve_app.access import install_cors, load_api_keys
from serve_app.backend import DEPLOYMENT_FAILED
from serve_app.errors import error_response, install_error_handlers
from serve_app.fanout import REPLICA_HEADER, FanOut
from serve_app.images import ImageLimits, load_images, mark_images
from serve_app.limits import BodyLimit, check_generated_tokens, check_size_limits
from serve_app.metrics import IngressMetrics, install_metrics
from serve_app.openapi import install_openapi
from serve_app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                TokenizeRequest)
from serve_app.reasoning import ReasoningParser, ThinkState
from serve_app.render import ChatRender, Renderer
from serve_app.responses import ResponseFormat
from serve_app.structured import after_reasoning
from serve_app.tools import ToolCallReader, choose_parser, tool_call_structural_tag

__all__ = ["OpenAIServer", "make_api", "REPLICA_HEADER", "VERSION"]
VERSION = "0.1.0"


class OpenAIServer:
    def __init__(self, config: AppConfig, renderer: Renderer, backend, max_model_len: int, block_size: int):
        self.config = config
        self.renderer = renderer
        self.backend = backend
        self.metrics = IngressMetrics()
        self.fanout = FanOut(backend, config.ingress, self.metrics)
        self.model_name = config.model_name()
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.reasoning = ReasoningParser(config.ingress.reasoning_parser, renderer.tokenizer)
        self._tool_parser: str | None = None
        self._asked_replicas = False
        self.image_limits = ImageLimits.from_config(config.ingress)
        self.api_keys = load_api_keys(config.ingress)

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
        keys = self.api_keys
        if not keys:
            return None
        auth = http.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not is_known_key(token, keys):
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
        try:  # bounded: a call to a deployment with no replica up waits until one is (Serve fails it only once
            # the controller has marked the deployment failed), and this request must not wait on it
            info = await asyncio.wait_for(self.backend.model_info(), self.config.ingress.health_timeout_s)
        except Exception:  # replicas not up yet: keep the static limit, ask again next time
            return
        self.max_model_len = min(self.max_model_len, info["max_model_len"])
        self._asked_replicas = True

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                               status_code=404, param="model", code="model_not_found")

    def check_deployment_limits(self, body: SamplingFields) -> None:
        """The 400s that need the deployment: n's limit, the size caps, token ids in the vocabulary."""
        if body.n > self.config.ingress.max_n:
            raise RequestError(f"n must be at most {self.config.ingress.max_n}", param="n")
        check_size_limits(body, self.config.ingress)
        vocab = len(self.renderer.tokenizer)
        if any(not 0 <= int(t) < vocab for t in body.logit_bias or {}):
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in body.stop_token_ids or []):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")

    def generate_requests(self, body: SamplingFields, prompt_token_ids: list[int], caller: str, key: str,
                          prompt_param: str, num_logprobs: int | None,
                          prompt_logprobs: int | None) -> list[GenerateRequest]:
        """n requests for one prompt: same routing hint; choice i > 0 gets a seed derived from (seed, i)."""
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the "
                               f"prompt has {num_prompt}.", param=prompt_param, code="context_length_exceeded")
        if body.max_tokens is not None and num_prompt + body.max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; {num_prompt} "
                               f"in the prompt + {body.max_tokens} max_tokens exceed it.", param="max_tokens",
                               code="context_length_exceeded")
        check_generated_tokens(body, num_prompt, self.max_model_len,
                               self.config.ingress.max_generated_tokens_per_request)
        requests = []
        for i in range(body.n):
            params = body.sampling_params(num_logprobs, prompt_logprobs)
            if params.seed is not None and i > 0:
                params.seed = (params.seed * 1_000_003 + i) % (1 << 63)
            requests.append(GenerateRequest(uuid.uuid4().hex, prompt_token_ids, params, caller=caller,
                                            route_key=key))
        return requests

    def retains(self, body: ChatCompletionRequest) -> bool:
        """Retention is on by default; the deployment's switch wins over the request's."""
        return self.config.engine.retain_token_ids and body.retain_token_ids is not False

    async def chat(self, body: ChatCompletionRequest, key_identity: str | None):
        start = time.perf_counter()
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        self.check_deployment_limits(body)
        await self.sync_limits()
        images = await self.chat_images(body)
        messages = [m.for_template() for m in body.messages]
        mark_images(messages, images)
        render = self.renderer.render_turn(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                           caller, self.model_name, self.retains(body), body.continue_final_message,
                                           body.tools)
        self.check_placeholders(render.prompt_token_ids, images)
        key = route_key(caller, self.model_name, messages=messages, block_size=self.block_size)
        requests = self.generate_requests(body, render.prompt_token_ids, caller, key, "messages",
                                          body.num_logprobs(), None)
        think = self.reasoning.state(render.prompt_token_ids, body.continue_final_message)
        for request in requests:
            request.images = images
            self._attach_retention(request, render)
            request.reasoning = think and think.value
            if request.sampling.structured is not None:  # the answer is constrained, never the reasoning
                request.sampling.structured = after_reasoning(request.sampling.structured, think,
                                                              self.reasoning.end_ids())
        tools = self._tool_use(body, requests, think)
        fmt = ResponseFormat("chat", body.request_id or f"chatcmpl-{requests[0].request_id}", self.model_name,
                             body.include_usage, body.return_token_ids, logprobs=body.logprobs,
                             token_bytes=self.renderer.token_bytes, think=think,
                             include_reasoning=body.include_reasoning, tools=tools)
        return await self.fanout.respond(requests, fmt, body.stream, start)

    async def chat_images(self, body: ChatCompletionRequest) -> list[ImageInput]:
        """The request's images, loaded and checked (serve_app/images.py); a model without a vision tower
        refuses the first image part."""
        first = next((f"messages[{i}].content[{j}]" for i, m in enumerate(body.messages)
                      for j, part in enumerate(m.content if isinstance(m.content, list) else [])
                      if part.get("type") == "image_url"), None)
        if first is None:
            return []
        if self.renderer.image_token_id is None:
            raise RequestError(f"{first}: model {self.model_name!r} takes no images", param=first)
        return await load_images(body.messages, self.image_limits)

    def check_placeholders(self, prompt_token_ids: list[int], images: list[ImageInput]) -> None:
        """One placeholder token per image, written by the template: any other count is an error."""
        if self.renderer.image_token_id is None:
            return
        count = prompt_token_ids.count(self.renderer.image_token_id)
        if count != len(images):
            raise RequestError(f"messages: the chat template wrote {count} image placeholder(s) for {len(images)} "
                               "image(s)", param="messages")

    @property
    def tool_parser(self) -> str:
        """The deployment's tool-call format (core/tool_calls/reader.py), read off the template at first use."""
        if self._tool_parser is None:
            template = getattr(self.renderer.tokenizer, "chat_template", None)
            self._tool_parser = choose_parser(self.config.ingress.tool_parser, template,
                                              bool(template) and self.renderer.supports_tools)
        return self._tool_parser

    def _tool_use(self, body: ChatCompletionRequest, requests: list[GenerateRequest], think) -> ToolCallReader | None:
        """How the replies are read for tool calls (None: not at all, as with tool_choice "none"); "required"
        and a named function are enforced by a grammar in the parser's own format (serve_app/tools/grammar.py),
        which replaces any response_format grammar: the reply is the call(s)."""
        if not body.tools or body.tool_choice == "none":
            return None
        may_think = think is ThinkState.MODEL  # the tag allows a <think> block (serve_app/tools/grammar.py)
        tag = tool_call_structural_tag(body.tools, body.tool_choice, self.tool_parser, body.parallel_tool_calls,
                                       optional_reasoning=may_think)
        if tag is not None:
            spec = StructuredSpec("structural_tag", json.dumps(tag), param="tool_choice",
                                  start_after=None if may_think else self.reasoning.start_after(think))
            for request in requests:
                request.sampling.structured = spec
        reader = ToolCallReader(self.tool_parser, body.tools, body.parallel_tool_calls)
        for request in requests:  # the replica keys the finished turn by the calls read out of it
            request.tool_reader = reader
        return reader

    def _attach_retention(self, request: GenerateRequest, render: ChatRender) -> None:
        request.history_key = render.history_key
        request.new_turn_span = render.new_turn_span
        request.conversation_key = render.conversation_key
        request.retention = render.retention
        if render.conversation_key is not None:
            request.turn_terminator_ids = self.renderer.turn_terminator()[1]

    async def completions(self, body: CompletionRequest, key_identity: str | None):
        start = time.perf_counter()
        caller = self.caller(key_identity, body.user)
        self.check_model(body.model)
        self.check_deployment_limits(body)
        await self.sync_limits()
        if body.suffix is not None:
            if not isinstance(body.prompt, str):
                raise RequestError("suffix needs a text prompt", param="suffix")
            ids = self.renderer.fim_prompt(body.prompt, body.suffix)
        else:
            ids = self.renderer.encode_prompt(body.prompt)
        if self.renderer.image_token_id is not None and self.renderer.image_token_id in ids:
            raise RequestError(f"prompt: token {self.renderer.image_token_id} is the image placeholder; images go "
                               "in chat messages (image_url parts)", param="prompt")
        key = route_key(caller, self.model_name, token_ids=ids, block_size=self.block_size,
                        num_route_blocks=self.config.router.num_route_blocks)
        requests = self.generate_requests(body, ids, caller, key, "prompt", body.logprobs,
                                          body.prompt_logprobs_needed())
        echo = None
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else self.renderer.tokenizer.decode(ids)
        fmt = ResponseFormat("completion", body.request_id or f"cmpl-{requests[0].request_id}", self.model_name,
                             body.include_usage, body.return_token_ids, logprobs=body.logprobs is not None,
                             echo_text=echo)
        return await self.fanout.respond(requests, fmt, body.stream, start)

    # -- token ids without generation ------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> dict:
        """With `messages`, the ids a chat generation's prompt would have with retention off."""
        self.check_model(body.model)
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            ids = self.renderer.render_chat(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                            body.tools)
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

    async def health(self) -> dict:
        """200 while at least one ModelReplica can serve: one sent a delta within `ingress.health_timeout_s`
        (a busy deployment is healthy: a probe would queue behind its work), or one answers a cheap call (no
        engine step) within that time; else a 503 saying why (none started yet, all failed, none answers)."""
        timeout_s = self.config.ingress.health_timeout_s
        if time.monotonic() - self.fanout.last_delta_at < timeout_s:
            return {"status": "ok"}
        try:
            await asyncio.wait_for(self.backend.model_info(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"no model replica can serve: none answered within {timeout_s:g} s",
                               status_code=503, type="server_unavailable") from None
        except Exception as exc:  # DeploymentUnavailableError (none can start), an engine that failed, ...
            raise RequestError(f"no model replica can serve: {_reason(exc)}", status_code=503,
                               type="server_unavailable") from exc
        return {"status": "ok"}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tether", "max_model_len": self.max_model_len}]}


def make_api(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="Tether", version=VERSION)
    install_error_handlers(app, server.config.ingress.retry_after_s)
    app.add_middleware(BodyLimit, max_body_bytes=server.config.ingress.max_body_bytes)  # 413s are counted too
    install_metrics(app, server.metrics)  # GET /metrics, and every response counted by route and status
    install_openapi(app, server)  # /openapi.json as precise as the validation (serve_app/openapi.py)
    install_cors(app, server.config.ingress)
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
        return await server.health()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        error = as_request_error(exc) or RequestError(f"internal error: {exc}", status_code=500,
                                                      type="internal_error")
        return error_response(error, server.config.ingress.retry_after_s)

    return app


def is_known_key(token: str, keys: Sequence[str]) -> bool:
    """Compares against every key in constant time, so the answer's timing tells nothing of a key's prefix."""
    given = token.encode()
    return any([hmac.compare_digest(given, key.encode()) for key in keys])


def _reason(exc: BaseException) -> str:
    """Why a replica call failed, in one line: the last line of an error that may have crossed Ray (a
    RayTaskError carries the remote traceback)."""
    from ray.serve.exceptions import DeploymentUnavailableError

    if isinstance(exc, DeploymentUnavailableError):  # its text is only the deployment's name
        return DEPLOYMENT_FAILED
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
