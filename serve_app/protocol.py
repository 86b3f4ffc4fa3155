"""OpenAI request models. Validation lives here: a bad value fails here, and the
ingress turns the failure into a 400 in OpenAI's error shape naming the field.

Checks that need the deployment (n's limit, the vocabulary, the context) are in
serve_app/routes.py. OpenAI fields Tether does not honour are refused with a
400 when set (never silently ignored); other unknown fields are ignored, as
OpenAI does. An explicit `null` means the field's default.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from core.messages import SamplingParams, StructuredSpec
from serve_app.structured import SpecError, structured_spec
from serve_app.tools.prompt import assistant_message
from serve_app.tools.validation import check_tool_choice, check_tools

# OpenAI fields not honoured: a request that sets one is refused, naming it.
NOT_SUPPORTED = ("functions", "function_call", "prediction", "audio", "modalities")
TEXT_PART_TYPES = ("text", "input_text")
IMAGE_PART_TYPE = "image_url"  # checked and loaded by serve_app/images.py (user messages only)
# apply_chat_template's own arguments: `chat_template` would run a client's Jinja (or pick another template),
# the rest change what rendering returns. Anything else in chat_template_kwargs is a template variable.
RESERVED_TEMPLATE_KWARGS = ("chat_template", "conversation", "messages", "tools", "tokenize",
                            "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                            "tokenizer_kwargs", "padding", "truncation", "max_length",
                            "return_assistant_tokens_mask")


def _is_unset(value) -> bool:
    return value is None or value == {} or value == []


def _template_variables(kwargs: dict | None) -> dict | None:
    reserved = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"{reserved[0]!r} is not a template variable; the deployment's chat template is used")
    return kwargs


class FieldError(ValueError):
    """A cross-field check failing, naming the field it blames (model validators have no location)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        # Every route that renders messages (chat, /tokenize) joins the parts' texts: each must be a string, whatever
        # the part's type says (for_template joins every part's "text").
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part.get("text", ""), str):
                raise ValueError(f"content[{j}].text must be a string")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, calls):
        for i, call in enumerate(calls or []):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tool_calls[{i}].function must be an object with a name")
            if not isinstance(function.get("arguments", ""), (str, dict)):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string or an object")
        return calls

    def for_template(self) -> dict:
        """The message as chat templates expect it: text parts joined into one string; with images, the parts
        as a list, each image as {"type": "image"} (the template writes the model's one placeholder token for
        it; the ingress adds the image's digest: serve_app/images.py mark_images)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and any(p.get("type") == IMAGE_PART_TYPE for p in self.content):
            out["content"] = [{"type": "image"} if p.get("type") == IMAGE_PART_TYPE
                              else {"type": "text", "text": p.get("text", "")} for p in self.content]
        elif isinstance(self.content, list):
            out["content"] = "\n".join(part.get("text", "") for part in self.content)
        if "reasoning" in out and "reasoning_content" not in out:  # vLLM's newer name: templates read the older
            out["reasoning_content"] = out.pop("reasoning")
        if self.role == "assistant" and self.tool_calls:  # arguments as objects (serve_app/tools/prompt.py)
            out.update(assistant_message(out.get("content"), self.tool_calls))
        return out


class SamplingFields(BaseModel):
    """What chat and completions share: sampling, limits, streaming, identity."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    return_token_ids: bool = False  # extension (vLLM): prompt_token_ids and each choice's token_ids
    # Extension (vLLM): one of json | json_object | regex | choice | grammar | structural_tag (serve_app/structured.py).
    structured_outputs: dict[str, Any] | None = None
    _structured: StructuredSpec | None = PrivateAttr(None)  # from response_format (chat) or structured_outputs
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None

    @field_validator(*NOT_SUPPORTED)
    @classmethod
    def _not_supported(cls, value, info):
        if not _is_unset(value):
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if stop == "" or isinstance(stop, list) and any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, bias):
        for key in bias or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
        return bias

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        if value not in (None, 1):
            raise ValueError("best_of > 1 is not supported; use n")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", "min_tokens must not exceed max_tokens")
        return self

    @model_validator(mode="after")
    def _structured_output(self):
        try:
            self._structured = structured_spec(getattr(self, "response_format", None), self.structured_outputs)
        except SpecError as exc:
            raise FieldError(exc.param, str(exc)) from None
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, num_logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        stop = self.stop_strings
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else max(self.top_k, 0),
            seed=self.seed, max_tokens=self.max_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): max(-100.0, min(100.0, v)) for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens, min_p=self.min_p, structured=self._structured,
            logprobs=num_logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TemplateInputs(BaseModel):
    """What renders with the messages through the chat template: chat and /tokenize take the same."""
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value):
        return check_tools(value) if value else value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _chat_template_kwargs(cls, value):
        return _template_variables(value)


class ChatCompletionRequest(SamplingFields, TemplateInputs):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: at most one call per reply
    # Extension: keep this turn's exact ids for the next turn (None: the deployment's default, on).
    retain_token_ids: bool | None = None
    # Extension (vLLM): false drops reasoning_content / reasoning from the reply (content is unchanged).
    include_reasoning: bool = True

    @model_validator(mode="before")
    @classmethod
    def _max_completion_tokens(cls, data):
        # OpenAI's newer name wins; folded in before the min_tokens check sees max_tokens.
        value = data.get("max_completion_tokens") if isinstance(data, dict) else None
        if isinstance(value, int) and value >= 1:  # a bad value stays to fail under its own name
            data = {**data, "max_tokens": value}
        return data

    @model_validator(mode="after")
    def _tool_choice(self):
        try:
            check_tool_choice(self.tool_choice, self.tools)
        except ValueError as exc:
            raise FieldError("tool_choice", str(exc)) from None
        return self

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message",
                               "continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError("continue_final_message", "continue_final_message needs a final assistant message")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.get("type") not in (*TEXT_PART_TYPES, IMAGE_PART_TYPE):
                    raise FieldError(f"messages[{i}].content[{j}]", f"content part type {part.get('type')!r} is "
                                                                     "not supported (text and image_url)")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (a list of prompts is not supported yet)")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs cannot be streamed")
        return self

    def prompt_logprobs_needed(self) -> int | None:
        """Logits at prompt positions: asked for, or echo with logprobs (the echoed prompt's logprobs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None


class TokenizeRequest(TemplateInputs):
    """vLLM's /tokenize: `prompt` (text or ids) or `messages` (rendered through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
