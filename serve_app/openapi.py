"""The served OpenAPI schema (/openapi.json): FastAPI's, made as precise as the validation, so it can be fuzzed.

FastAPI derives the request bodies from serve_app/protocol.py's pydantic models; this adds what pydantic
does not emit, read off the deployment when the schema is first asked for:
1. `model` as an enum of the served name (anything else is a 404, documented as such);
2. the checks pydantic runs in code: non-empty stop strings, token ids in the vocabulary, `n` within
   `ingress.max_n`, `max_tokens` within the context, the ingress' request limits, `best_of` 1, fields
   Tether refuses (unset only), the shapes of content parts, tools, tool calls and structured outputs, one
   prompt per request, and the cross-field checks JSON Schema can say (tool_choice needs tools,
   top_logprobs needs logprobs, a message needs content unless it makes tool calls, ...);
3. an explicit null as every optional field's default on the generation routes (protocol.py drops them);
4. the 200 bodies, and every error status as OpenAI's error shape (FastAPI's 422 is never sent: a bad
   body is a 400 naming the field, serve_app/errors.py);
5. a link from /tokenize's ids to /v1/completions' prompt, for stateful tests.
What JSON Schema cannot say (min_tokens <= max_tokens, the prompt's tokens + max_tokens within the context,
distinct tool names, a schema, regex or grammar that compiles, what a chat template refuses) stays a 400
naming the field. Where the validation is wider than a simple schema (logit_bias keys, structured_outputs),
the schema states a subset: what it allows is accepted (tests/unit/test_protocol_properties.py).
"""

from dataclasses import dataclass

from fastapi.openapi.utils import get_openapi


@dataclass(frozen=True)
class Deployment:
    """What the schema states that the pydantic models cannot know."""

    model_name: str
    vocab_size: int
    max_n: int
    max_model_len: int
    takes_images: bool
    has_auth: bool
    limits: tuple = ()  # (name, value) of the ingress' request limits (core/app_config.py, ingress.max_*)

    @classmethod
    def of(cls, server) -> "Deployment":
        ingress = server.config.ingress
        limits = tuple((name, getattr(ingress, name)) for name in LIMITS if getattr(ingress, name, None) is not None)
        return cls(server.model_name, len(server.renderer.tokenizer), ingress.max_n, server.max_model_len,
                   server.renderer.image_token_id is not None, bool(server.api_keys), limits)

    def limit(self, name: str) -> dict:
        """{keyword: the limit} for a JSON Schema keyword, or {} where the deployment sets none."""
        value = dict(self.limits).get(name)
        return {} if value is None else {LIMITS[name]: value}


# ingress limit -> the JSON Schema keyword stating it
LIMITS = {"max_messages": "maxItems", "max_content_parts": "maxItems", "max_stop_strings": "maxItems",
          "max_stop_string_chars": "maxLength", "max_logit_bias": "maxProperties"}


def install_openapi(app, server) -> None:
    """Replaces FastAPI's schema builder; the schema is built once, at the first request for it."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = served_schema(app, Deployment.of(server))
        return app.openapi_schema

    app.openapi = openapi


def served_schema(app, deployment: Deployment) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    refine_requests(components, deployment)
    components.update(response_components(deployment))
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            document_responses(path, method, operation, deployment)
    link_tokenize(schema["paths"], deployment)
    if deployment.has_auth:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema


# -- 1-3: request bodies ----------------------------------------------------------------------------------

NOT_SUPPORTED = {"enum": [None, {}, []], "description": "Not supported: refused with a 400 unless unset."}
TEXT = {"type": "string"}
NON_EMPTY_TEXT = {"type": "string", "minLength": 1}


def refine_requests(components: dict, d: Deployment) -> None:
    message = components["ChatMessage"]["properties"]
    parts = {"type": "array", "items": content_part(d), **d.limit("max_content_parts")}
    message["content"] = {"anyOf": [TEXT, parts, {"type": "null"}]}
    message["tool_calls"] = {"anyOf": [{"type": "array", "items": TOOL_CALL}, {"type": "null"}]}
    components["ChatMessage"]["anyOf"] = MESSAGE_NEEDS_CONTENT
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        generation_body(components[name], d)
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"].update(d.limit("max_messages"))
    chat["max_completion_tokens"] = nullable(max_tokens(d))
    chat["tools"], chat["tool_choice"] = nullable(TOOLS), nullable(TOOL_CHOICE)
    chat["response_format"] = nullable(RESPONSE_FORMAT)
    components["ChatCompletionRequest"]["allOf"] = CHAT_CROSS_FIELD
    components["CompletionRequest"]["allOf"] = COMPLETION_CROSS_FIELD
    completion = components["CompletionRequest"]["properties"]
    completion["prompt"] = prompt(d, min_items=1)
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        components[name]["properties"]["model"] = nullable(served_model(d))
    tokenize = components["TokenizeRequest"]
    tokenize["properties"]["prompt"] = nullable(prompt(d, min_items=0, one_of_many=False))
    tokenize["properties"]["tools"] = nullable(TOOLS)
    tokenize["oneOf"] = [  # exactly one of prompt or messages
        {"required": ["prompt"], "properties": {"prompt": {"type": ["string", "array"]}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]
    components["DetokenizeRequest"]["properties"]["tokens"] = token_ids(d)


def generation_body(body: dict, d: Deployment) -> None:
    """Chat and completions: SamplingFields' checks, then every optional field nullable."""
    props = body["properties"]
    props["model"] = served_model(d)
    props["n"] = {**props["n"], "maximum": d.max_n}
    props["max_tokens"] = max_tokens(d)
    stop = {**NON_EMPTY_TEXT, **d.limit("max_stop_string_chars")}
    props["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, **d.limit("max_stop_strings")}]}
    props["stop_token_ids"] = token_ids(d, min_items=0)
    props["logit_bias"] = {"type": "object", "additionalProperties": {"type": "number"},
                           "propertyNames": {"pattern": token_id_pattern(d.vocab_size)},
                           **d.limit("max_logit_bias"),
                           "description": f"Token ids in [0, {d.vocab_size}) -> a bias, clamped to [-100, 100]."}
    props["best_of"] = {"enum": [1]}
    props["structured_outputs"] = STRUCTURED_OUTPUTS
    for name in ("functions", "function_call", "prediction", "audio", "modalities"):
        props[name] = NOT_SUPPORTED
    required = set(body.get("required", []))
    for name, prop in props.items():
        if name not in required:
            props[name] = nullable(prop)


def nullable(prop: dict) -> dict:
    """The field's schema or null (protocol.py treats an explicit null as the default)."""
    options = prop.get("anyOf", [prop])
    if {"type": "null"} in options or None in prop.get("enum", [None]):
        return prop
    meta = {k: prop[k] for k in ("title", "description", "default") if k in prop}
    core = {k: v for k, v in prop.items() if k not in meta}
    return {**meta, "anyOf": [core, {"type": "null"}]}


def served_model(d: Deployment) -> dict:
    return {"type": "string", "enum": [d.model_name], "description": "The served model (else a 404)."}


def max_tokens(d: Deployment) -> dict:
    return {"type": "integer", "minimum": 1, "maximum": d.max_model_len - 1,
            "description": f"The prompt's tokens plus max_tokens must fit the context ({d.max_model_len})."}


def token_ids(d: Deployment, min_items: int = 0) -> dict:
    return {"type": "array", "minItems": min_items,
            "items": {"type": "integer", "minimum": 0, "maximum": d.vocab_size - 1}}


def token_id_pattern(vocab_size: int) -> str:
    """Decimal ids with fewer digits than the largest: a subset of [0, vocab) a regex says simply."""
    return "^(0|[1-9][0-9]{0,%d})$" % max(len(str(vocab_size - 1)) - 2, 0)


def prompt(d: Deployment, min_items: int, one_of_many: bool = True) -> dict:
    """Text or token ids; completions also take a list of one text or one id list (one prompt a request)."""
    ids = {**token_ids(d, min_items=max(min_items, 1) if one_of_many else min_items),
           "maxItems": d.max_model_len - 1}
    options = [NON_EMPTY_TEXT if one_of_many else TEXT, ids]
    if one_of_many:
        options += [{"type": "array", "items": NON_EMPTY_TEXT, "minItems": 1, "maxItems": 1},
                    {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]
    return {"anyOf": options}


def content_part(d: Deployment) -> dict:
    text = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "input_text"]}, "text": TEXT}}
    if not d.takes_images:
        return text
    image = {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"}, "image_url": {"type": "object", "required": ["url"],
                                                      "properties": {"url": TEXT}}}}
    return {"anyOf": [text, image]}


UNSET, OFF = {"type": "null"}, {"enum": [False, None]}
# OpenAI's rule, and what chat templates read: content, unless an assistant message makes tool calls.
MESSAGE_NEEDS_CONTENT = [
    {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
    {"required": ["role", "tool_calls"], "properties": {"role": {"const": "assistant"},
                                                        "tool_calls": {"type": "array", "minItems": 1}}}]
CHAT_CROSS_FIELD = [  # the cross-field checks JSON Schema can state (protocol.py's FieldError)
    {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", None]}}},
               {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]},
    {"anyOf": [{"properties": {"top_logprobs": UNSET}}, {"required": ["logprobs"],
                                                         "properties": {"logprobs": {"const": True}}}]},
    {"anyOf": [{"properties": {"continue_final_message": OFF}}, {
        "required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}}]},
]
COMPLETION_CROSS_FIELD = [{"anyOf": [{"properties": {"prompt_logprobs": UNSET}}, {"properties": {"stream": OFF}}]}]


FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
TOOLS = {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": FUNCTION_NAME, "description": TEXT,
        "parameters": {"type": "object", "properties": {"type": {"const": "object"}}}}}}},
    "description": "Function names are distinct."}
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": FUNCTION_NAME}}}}],
    "description": "Anything but \"none\" needs tools; a named function must be in tools."}
TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": TEXT, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": FUNCTION_NAME, "arguments": {"anyOf": [TEXT, {"type": "object"}]}}}}}
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"}, "json_schema": {"type": "object", "required": ["name", "schema"],
                                                          "properties": {"name": TEXT,
                                                                         "schema": {"type": "object"}}}}}],
    "description": "A json_schema or structural_tag that does not compile is a 400 naming response_format."}
STRUCTURED_OUTPUTS = {"anyOf": [
    {"type": "object", "maxProperties": 0},
    {"type": "object", "required": ["json_object"], "additionalProperties": False,
     "properties": {"json_object": {"const": True}}},
    {"type": "object", "required": ["choice"], "additionalProperties": False,
     "properties": {"choice": {"type": "array", "minItems": 1, "items": NON_EMPTY_TEXT}}},
    {"type": "object", "required": ["json"], "additionalProperties": False,
     "properties": {"json": {"type": "object", "properties": {"type": {"const": "object"}}}}}],
    "description": "Exactly one of json | json_object | regex | choice | grammar | structural_tag; a regex, "
                   "grammar or tag that does not compile is a 400 naming structured_outputs."}


# -- 4: responses -----------------------------------------------------------------------------------------

ERROR_STATUSES = {400: "A field is invalid; `param` names it.", 401: "Missing or invalid API key.",
                  404: "The model is not served.", 413: "The request is too large.",
                  429: "Too many requests queued; retry after Retry-After.", 500: "Internal error.",
                  503: "No model replica can serve now; retry after Retry-After."}
NULLABLE_TEXT = {"type": ["string", "null"]}
INT = {"type": "integer"}


def response_components(d: Deployment) -> dict:
    model = {"type": "string", "enum": [d.model_name]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT}}
    choice = {"type": "object", "required": ["index", "finish_reason"],
              "properties": {"index": INT, "finish_reason": NULLABLE_TEXT, "token_ids": {"type": "array"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": NULLABLE_TEXT, "tool_calls": {"type": "array"}}}

    def envelope(obj: str, choice_props: dict, required: list[str]) -> dict:
        item = {**choice, "required": choice["required"] + required,
                "properties": {**choice["properties"], **choice_props}}
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": TEXT, "object": {"const": obj}, "created": INT, "model": model,
                               "choices": {"type": "array", "minItems": 1, "items": item}, "usage": usage}}

    return {
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": TEXT, "type": TEXT, "param": NULLABLE_TEXT, "code": {"type": ["string", "null"]}}}}},
        "ChatCompletion": envelope("chat.completion", {"message": message}, ["message"]),
        "Completion": envelope("text_completion", {"text": TEXT}, ["text"]),
        "Tokens": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": INT, "max_model_len": {"const": d.max_model_len}, "tokens": {"type": "array", "items": INT}}},
        "Text": {"type": "object", "required": ["prompt"], "properties": {"prompt": TEXT}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object"], "properties": {"id": model,
                                                                               "object": {"const": "model"}}}}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
        "Version": {"type": "object", "required": ["version"], "properties": {"version": TEXT}},
    }


OK_BODIES = {"/v1/chat/completions": "ChatCompletion", "/v1/completions": "Completion", "/tokenize": "Tokens",
             "/v1/tokenize": "Tokens", "/detokenize": "Text", "/v1/detokenize": "Text", "/v1/models": "ModelList",
             "/health": "Health", "/version": "Version"}
STREAMED = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}}}, "description": "With stream: true, `data: {chunk}` events, then `data: [DONE]`."}}


def document_responses(path: str, method: str, operation: dict, d: Deployment) -> None:
    """200 with its body (and the event stream where it streams); every error status the route can send."""
    content = {"application/json": {"schema": ref(OK_BODIES[path])}} if path in OK_BODIES else {}
    if path in ("/v1/chat/completions", "/v1/completions"):
        content.update(STREAMED)
    responses = {"200": {"description": "OK", "content": content}}
    statuses = [500] if path in ("/version",) else [503] if path == "/health" else [400, 404, 413, 500, 503]
    if path in ("/v1/chat/completions", "/v1/completions"):
        statuses.append(429)
    if d.has_auth and path not in ("/health", "/version"):
        statuses.append(401)
    for status in sorted(statuses):
        responses[str(status)] = {"description": ERROR_STATUSES[status],
                                  "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    operation["responses"] = responses


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


# -- 5: links ---------------------------------------------------------------------------------------------

def link_tokenize(paths: dict, d: Deployment) -> None:
    """/tokenize's ids are a valid /v1/completions prompt (the same model, the same vocabulary)."""
    link = {"operationId": paths["/v1/completions"]["post"]["operationId"],
            "requestBody": {"model": d.model_name, "prompt": "$response.body#/tokens",
                            "max_tokens": 4}}
    for path in ("/tokenize", "/v1/tokenize"):
        paths[path]["post"]["responses"]["200"]["links"] = {"Complete": link}
