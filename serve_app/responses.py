"""OpenAI response bodies and stream chunks, for chat and completions, with n choices.

Extensions (vLLM's shape, so existing clients work): with `return_token_ids`,
chat bodies carry `prompt_token_ids` at the top level and `token_ids` in each
choice; completions carry both in the choice. Stream chunks carry each delta's
`token_ids`, and a choice's first chunk the `prompt_token_ids`.

Chat replies of a reasoning model (serve_app/reasoning.py) carry `reasoning_content` and `reasoning` beside
`content`, per choice; logprobs still list every generated token, reasoning and tags included.
"""

import time
from dataclasses import dataclass, field

from core.messages import GenerateDelta, TokenLogprob
from core.reasoning import ReasoningSplitter, ThinkState, split_reasoning
from serve_app.tools import ToolCallReader

SYSTEM_FINGERPRINT = "tether-0.1.0"


@dataclass
class ChoiceResult:
    """One choice, gathered from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first: GenerateDelta | None = None
    last: GenerateDelta | None = None

    def add(self, delta: GenerateDelta) -> None:
        self.first = self.first or delta
        self.last = delta
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []


def usage(lasts: list[GenerateDelta]) -> dict:
    """The prompt counted once (choice 0's), completions summed."""
    head = lasts[0]
    completion = sum(d.num_generated_tokens for d in lasts)
    return {"prompt_tokens": head.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": head.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": head.num_cached_tokens,
                                      "retained_tokens": head.num_retained_tokens, "retention": head.retention},
            "completion_tokens_details": {"reasoning_tokens": sum(d.num_reasoning_tokens for d in lasts)}}


def chat_logprobs(entries: list[TokenLogprob], token_bytes) -> dict:
    """OpenAI's chat shape; `bytes` are each token's own bytes, so a character split across tokens
    is rebuilt by joining them (its pieces alone spell U+FFFD)."""
    def one(token_id: int, token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": token_bytes(token_id)}

    return {"content": [{**one(e.token_id, e.token, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob | None], text_start: int = 0) -> dict:
    """tokens, token_logprobs, top_logprobs, text_offset; a None entry (the first prompt token) has no logprob."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_start
    for e in entries:
        if e is None:
            tokens.append(None), token_logprobs.append(None), tops.append(None), offsets.append(offset)
            continue
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        tops.append({t: lp for _, t, lp in e.top})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_shape(entries: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> {logprob, decoded_token}, the prompt's
    own token first, then the most likely; None for the first position."""
    def one(e: TokenLogprob) -> dict:
        out = {str(e.token_id): {"logprob": e.logprob, "decoded_token": e.token}}
        out.update({str(t): {"logprob": lp, "decoded_token": tok} for t, tok, lp in e.top if t != e.token_id})
        return out

    return [None if e is None else one(e) for e in entries]


@dataclass
class ResponseFormat:
    """One request's response id, model, kind and options; builds its bodies and chunks."""

    kind: str  # "chat" | "completion"
    id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: bool = False
    echo_text: str | None = None  # completions with echo: the prompt leads the text
    token_bytes: object = None  # token id -> its bytes (Renderer.token_bytes), for chat logprobs
    think: ThinkState | None = None  # chat replies split into reasoning and content from this state; None: not
    include_reasoning: bool = True
    tools: ToolCallReader | None = None  # chat replies read for tool calls (serve_app/tools/); None: not
    created: int = field(default_factory=lambda: int(time.time()))
    _splitters: dict = field(default_factory=dict, repr=False)  # choice index -> its stream's ReasoningSplitter
    _tool_streams: dict = field(default_factory=dict, repr=False)  # choice index -> its ToolCallStream

    # -- the split: tool-call parsing runs on the content these return, never on reasoning --

    def message_parts(self, choice: ChoiceResult) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished chat choice; unsplit: (None, the whole text)."""
        if self.think is None:
            return None, choice.text
        return split_reasoning(choice.text, self.think)

    def delta_parts(self, index: int, delta: GenerateDelta) -> tuple[str, str]:
        """(reasoning, content) text of choice `index`'s next streamed delta ("" for none). Call once per delta,
        in order: text that may be a split tag waits for the next delta, and the last delta flushes it."""
        if self.think is None:
            return "", delta.text
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.think))
        reasoning, content = splitter.feed(delta.text)
        if delta.finish_reason:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def tool_parts(self, index: int, delta: GenerateDelta, content: str) -> tuple[str, list[dict], str | None]:
        """(content, delta.tool_calls fragments, finish_reason) of choice `index`'s next streamed content."""
        stream = self._tool_streams.setdefault(index, self.tools.stream())
        out = stream.feed(content)
        if delta.finish_reason:
            out += stream.finish()
        return out.content, out.tool_calls, self.tools.finish_reason(delta.finish_reason, stream.has_calls)

    def _with_reasoning(self, message: dict, reasoning: str | None, always: bool) -> dict:
        # Both names: `reasoning_content` (DeepSeek's, most clients) and `reasoning` (vLLM's newer one).
        if self.think is not None and self.include_reasoning and (reasoning or always):
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}

    def _echo_logprobs(self, first: GenerateDelta) -> list:
        return list(first.prompt_logprobs or []) if self.echo_text is not None else []

    def body(self, choices: list[ChoiceResult]) -> dict:
        out_choices = []
        for c in choices:
            choice = {"index": c.index, "logprobs": None, "finish_reason": c.last.finish_reason}
            if self.kind == "chat":
                reasoning, content = self.message_parts(c)
                message = {"role": "assistant", "content": content}
                if self.tools is not None:
                    parsed, calls = self.tools.parse(content or "")
                    if calls:  # content: the text around the calls, or None
                        message.update(content=parsed, tool_calls=calls)
                        choice["finish_reason"] = self.tools.finish_reason(c.last.finish_reason, True)
                choice["message"] = self._with_reasoning(message, reasoning, always=True)
                if self.logprobs:
                    choice["logprobs"] = chat_logprobs(c.logprobs, self.token_bytes)
            else:
                choice["text"] = (self.echo_text or "") + c.text
                if self.logprobs:
                    choice["logprobs"] = completion_logprobs(self._echo_logprobs(c.first) + c.logprobs)
                if c.first.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_shape(c.first.prompt_logprobs)
            if self.return_token_ids:
                choice["token_ids"] = c.token_ids
                if self.kind == "completion":
                    choice["prompt_token_ids"] = c.first.prompt_token_ids
            out_choices.append(choice)
        out = self._envelope("chat.completion" if self.kind == "chat" else "text_completion", out_choices)
        if self.return_token_ids and self.kind == "chat":
            out["prompt_token_ids"] = choices[0].first.prompt_token_ids
        out["usage"] = usage([c.last for c in choices])
        return out

    def chunk(self, delta: GenerateDelta, index: int, first: bool = False) -> dict | None:
        """The chunk of one delta of choice `index`; a choice's first chunk carries the role and prompt ids.
        None when a split reply's delta has nothing to send yet (its text held back or dropped reasoning)."""
        choice = {"index": index, "logprobs": None, "finish_reason": delta.finish_reason}
        if self.kind == "chat":
            reasoning, content = self.delta_parts(index, delta)
            tool_calls = None
            if self.tools is not None:
                content, tool_calls, choice["finish_reason"] = self.tool_parts(index, delta, content)
            message = {"role": "assistant"} if first else {}
            if content or first or not (delta.finish_reason or self.think or self.tools):
                message["content"] = content
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice["delta"] = self._with_reasoning(message, reasoning, always=False)
            if ((self.think is not None or self.tools is not None)
                    and not (message or first or delta.finish_reason or delta.logprobs or self.return_token_ids)):
                return None
            if self.logprobs:
                choice["logprobs"] = chat_logprobs(delta.logprobs or [], self.token_bytes)
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            echo = (self.echo_text or "") if first else ""
            choice["text"] = echo + delta.text
            if self.logprobs:
                choice["logprobs"] = completion_logprobs((self._echo_logprobs(delta) if first else [])
                                                         + (delta.logprobs or []))
            out = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                (out if self.kind == "chat" else choice)["prompt_token_ids"] = delta.prompt_token_ids
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, lasts: list[GenerateDelta]) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(lasts)
        return out
