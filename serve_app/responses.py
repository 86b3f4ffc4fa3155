"""OpenAI response bodies and stream chunks, for chat and completions."""

import time

from replicas.messages import GenerateDelta


def usage(last: GenerateDelta) -> dict:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_generated_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


class ResponseFormat:
    """One request's response id, model and kind; builds its bodies and chunks."""

    def __init__(self, kind: str, response_id: str, model: str):
        self.kind = kind  # "chat" | "completion"
        self.id = response_id
        self.model = model
        self.created = int(time.time())

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def body(self, text: str, last: GenerateDelta) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage(last)
        return out

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, last: GenerateDelta) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(last)
        return out
