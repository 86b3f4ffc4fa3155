"""OpenAI response bodies and stream chunks, for chat and completions.

Extensions (vLLM's shape, so existing clients work): with `return_token_ids`,
chat bodies carry `prompt_token_ids` at the top level and `token_ids` in each
choice; completions carry both in the choice. Stream chunks carry each delta's
`token_ids`, and the first chunk the `prompt_token_ids`.
"""

import time
from dataclasses import dataclass, field

from replicas.messages import GenerateDelta


def usage(last: GenerateDelta) -> dict:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_generated_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens,
                                      "retained_tokens": last.num_retained_tokens,
                                      "retention": last.retention}}


@dataclass
class ResponseFormat:
    """One request's response id, model, kind and options; builds its bodies and chunks."""

    kind: str  # "chat" | "completion"
    id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def body(self, text: str, token_ids: list[int], prompt_token_ids: list[int], last: GenerateDelta) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            out = self._envelope("chat.completion", [choice])
        else:
            choice["text"] = text
            out = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            (out if self.kind == "chat" else choice)["prompt_token_ids"] = prompt_token_ids
        out["usage"] = usage(last)
        return out

    def chunk(self, delta: GenerateDelta, first: bool = False) -> dict:
        """The chunk of one delta; `first` also carries the prompt ids (and the role, for chat)."""
        choice = {"index": 0, "logprobs": None, "finish_reason": delta.finish_reason}
        if self.kind == "chat":
            content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            choice["delta"] = {} if delta.finish_reason and not delta.text and not first else content
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = delta.text
            out = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                (out if self.kind == "chat" else choice)["prompt_token_ids"] = delta.prompt_token_ids
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, last: GenerateDelta) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(last)
        return out
