"""OpenAI request models. Validation lives here: a bad value fails here, and the
ingress turns the failure into a 400 in OpenAI's error shape naming the field.

Fields OpenAI defines that Tether does not honour yet are refused with a 400
when set (never silently ignored). Other unknown fields are ignored, as vLLM
does. An explicit `null` means the field's default, as OpenAI treats it.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.messages import SamplingParams


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


# OpenAI fields not honoured yet: a request that sets one is refused, naming it.
NOT_YET_SUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
                     "top_logprobs", "best_of", "min_p", "repetition_penalty", "min_tokens", "prediction",
                     "audio", "modalities")


def _is_unset(value) -> bool:
    return value is None or value == {} or value == []


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
    n: int = Field(1, ge=1, le=1, description="n > 1 (fan-out) is not served yet")
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # extension (vLLM): prompt_token_ids and each choice's token_ids
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    best_of: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None

    @field_validator(*NOT_YET_SUPPORTED)
    @classmethod
    def _not_supported_yet(cls, value, info):
        if not _is_unset(value):
            raise ValueError(f"{info.field_name} is not supported yet")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if isinstance(stop, list) and any(s == "" for s in stop) or stop == "":
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _not_yet_honoured(cls, value, info):
        if value != 0.0:
            raise ValueError(f"{info.field_name} is not supported yet; leave it at 0")
        return value

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else max(self.top_k, 0),
            seed=self.seed, max_tokens=self.max_tokens or default_max_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    # Extension: keep this turn's exact ids for the next turn (None: the deployment's default, on).
    retain_token_ids: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs is not supported yet")
        return value

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None

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

    @field_validator("echo", "suffix", "logprobs")
    @classmethod
    def _not_yet_supported(cls, value, info):
        if value is not None and value is not False:
            raise ValueError(f"{info.field_name} is not supported yet")
        return value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: `prompt` (text or ids) or `messages` (rendered through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
