"""Renderer: the one place a request becomes token ids, through the model's own tokenizer and chat template.

For a chat turn it also finds what retention needs (replicas/engine/retention.py):

    history  = messages up to and including the last assistant message
    (a)      = render(history), no generation prompt
    (b)      = render(messages), with the generation prompt       <- the prompt when nothing is retained
    new turn = the exact ids (b) holds for the messages after the history:
               (b) minus (a) when (b) starts with (a); otherwise (the template rewrote an earlier
               turn, e.g. dropped its reasoning) the boundary is found with a sentinel in place of
               the last history message's content, exactly, or the turn falls back to (b).
"""

import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property

from core.hashing import history_key
from core.messages import RequestError
from core.tokenizer import load_tokenizer
from serve_app.tools.prompt import PROBE_TOOL, hermes_messages, uses_tools

logger = logging.getLogger("ray.serve")

SENTINEL = "\u2063tether\u2063sentinel\u2063"
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def image_token_id(model_dir: str, tokenizer) -> int | None:
    """The placeholder the chat template writes per image, for a checkpoint with a vision tower; else None."""
    path = os.path.join(model_dir, "config.json")
    config = json.load(open(path)) if os.path.exists(path) else {}
    token = config.get("image_token_id")
    if "vision_config" not in config or token is None:
        return None
    return int(token)


def bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's byte -> printable character table (GPT-2's): printable bytes map to themselves,
    the rest to the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(slots=True)
class ChatRender:
    prompt_token_ids: list[int]  # (b)
    history_key: str | None = None
    new_turn_span: tuple[int, int] | None = None
    conversation_key: str | None = None
    retention: str = "off"


# The vision control tokens: written by the template only. Typed into a message they are text (seed 001).
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
_LITERAL = re.compile("\ue000([0-9])\ue001")  # a message's literal vision token, until encode


class Renderer:
    def __init__(self, model_dir: str):
        self.tokenizer = load_tokenizer(model_dir)
        self.image_token_id = image_token_id(model_dir, self.tokenizer)  # None: the model takes no images
        vocab = self.tokenizer.get_vocab()
        self._literals = [token for token in VISION_TOKENS if token in vocab]
        self._terminator: tuple[str, list[int]] | None = None
        self._byte_decoder = {ch: b for b, ch in bytes_to_unicode().items()}
        self._token_bytes: dict[int, list[int]] = {}

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's own bytes (a byte-level BPE token may hold part of a UTF-8 character); cached."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(ch in self._byte_decoder for ch in piece):
                cached = [self._byte_decoder[ch] for ch in piece]
            else:  # special tokens, or a tokenizer that is not byte-level
                cached = list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))
            self._token_bytes[token_id] = cached
        return cached

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
                    tools: list[dict] | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions", param="messages")
        if uses_tools(messages, tools) and not self.supports_tools:
            messages, tools = hermes_messages(messages, tools), None
        messages = self._escape_literals(messages)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as exc:  # the template's own checks (roles, alternation) raise here
            raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders `tools` (passing them changes the text). One without tool support gets
        the tools and tool turns in Hermes form instead (serve_app/tools/prompt.py), logged once here."""
        probe = [{"role": "user", "content": "x"}]
        try:
            render = lambda tools: self.tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)  # noqa: E731
            supported = render([PROBE_TOOL]) != render(None)
        except Exception:  # a template that fails on tools cannot render them either
            supported = False
        if not supported:
            logger.warning("the chat template ignores `tools`: requests with tools get them in a Hermes-style "
                           "system prompt, and tool turns as <tool_call> / <tool_response> text")
        return supported

    def encode(self, text: str) -> list[int]:
        # Rendered text holds its special tokens already: add none. A vision token a message typed
        # (escaped by render_text) is encoded as the text it is, never as the token.
        if not self._literals or "\ue000" not in text:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids, pieces = [], _LITERAL.split(text)
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.tokenizer.encode(piece, add_special_tokens=False) if piece else []
            else:
                ids += self.tokenizer(self._literals[int(piece)], add_special_tokens=False,
                                      split_special_tokens=True)["input_ids"]
        return ids

    def _escape_literals(self, messages: list[dict]) -> list[dict]:
        """Messages whose text holds a vision token string, with each replaced by a private marker (encode
        turns it back into that string's text tokens)."""
        if not self._literals:
            return messages

        def escape(text):
            if not isinstance(text, str) or not any(token in text for token in self._literals):
                return text
            for k, token in enumerate(self._literals):
                text = text.replace(token, f"\ue000{k}\ue001")
            return text

        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = [{**part, "text": escape(part["text"])} if "text" in part else part for part in content]
            out.append({**message, "content": escape(content)} if content is not None else message)
        return out

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_text(messages, add_generation_prompt, chat_template_kwargs, tools=tools))

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:  # text the tokenizer drops whole (SmolLM2's drops control characters such as "\x16")
            raise RequestError("prompt encodes to no tokens with this model's tokenizer", param="prompt")
        return ids

    def fim_prompt(self, prompt: str, suffix: str) -> list[int]:
        """Fill in the middle (prefix-suffix-middle order) with the vocabulary's own FIM tokens."""
        vocab = self.tokenizer.get_vocab()
        for names in (FIM_TOKENS, tuple(f"<|{n[1:-1]}|>" for n in FIM_TOKENS)):
            if all(name in vocab for name in names):
                prefix_id, suffix_id, middle_id = (vocab[name] for name in names)
                encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
                return [prefix_id] + encode(prompt) + [suffix_id] + encode(suffix) + [middle_id]
        raise RequestError("suffix needs a model whose vocabulary has fill-in-the-middle tokens; this one has none",
                           param="suffix")

    def turn_terminator(self) -> tuple[str, list[int]]:
        """What the template writes after an assistant reply's content when the conversation goes on (SmolLM2:
        '<|im_end|>\\n'; Llama 3: '<|eot_id|>'): the tokens a reply is followed by both at the end of the
        conversation and before a next user message. Not what ends a whole conversation only (Phi-3 writes
        its eos there)."""
        if self._terminator is None:
            reply = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]
            last = self._after_sentinel(self.render_text(reply, add_generation_prompt=False))
            followed = self._after_sentinel(self.render_text(reply + [{"role": "user", "content": "y"}],
                                                             add_generation_prompt=False))
            encoding = self.tokenizer(last, add_special_tokens=False, return_offsets_mapping=True)
            ids, followed_ids, num_common = encoding["input_ids"], self.encode(followed), 0
            while num_common < min(len(ids), len(followed_ids)) and ids[num_common] == followed_ids[num_common]:
                num_common += 1
            end = encoding["offset_mapping"][num_common - 1][1] if num_common else 0
            self._terminator = (last[:end], ids[:num_common])
        return self._terminator

    @staticmethod
    def _after_sentinel(text: str) -> str:
        return text[text.index(SENTINEL) + len(SENTINEL):]

    def render_turn(self, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
                    caller: str, model: str, retain: bool, continue_final_message: bool = False,
                    tools: list[dict] | None = None) -> ChatRender:
        b_text = self.render_text(messages, add_generation_prompt, chat_template_kwargs, continue_final_message,
                                  tools)
        render = ChatRender(self.encode(b_text))
        if not retain or continue_final_message:  # a continued reply is no finished turn to keep
            return render
        options = {"add_generation_prompt": add_generation_prompt, "chat_template_kwargs": chat_template_kwargs}
        if tools:  # they render into the prompt: kept ids are only reused under the same tools
            options["tools"] = tools
        render.conversation_key = history_key(caller, model, options, messages)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            render.retention = "first turn"
            return render
        if last == len(messages) - 1:
            render.retention = "fallback: the conversation ends with an assistant message"
            return render
        history = messages[:last + 1]
        start, reason = self._new_turn_start(history, messages, b_text, render.prompt_token_ids,
                                             add_generation_prompt, chat_template_kwargs, tools)
        if start is None:
            render.retention = f"fallback: {reason}"
            return render
        render.history_key = history_key(caller, model, options, history)
        render.new_turn_span = (start, len(render.prompt_token_ids))
        render.retention = "span"
        return render

    def _new_turn_start(self, history, messages, b_text, b_ids, add_generation_prompt, kwargs, tools=None):
        """Index in (b)'s ids where the new messages start, or (None, why not)."""
        a_ids = self.encode(self.render_text(history, False, kwargs, tools=tools))
        if b_ids[:len(a_ids)] == a_ids:
            return len(a_ids), None
        # The template rewrote the history: render once more with a sentinel as the last history
        # message's content; everything after its terminator is the new messages, as (b) renders them.
        marked = [dict(m) for m in messages]
        marked[len(history) - 1]["content"] = SENTINEL
        marked[len(history) - 1].pop("tool_calls", None)  # they render after the content: the sentinel must end it
        e_text = self.render_text(marked, add_generation_prompt, kwargs, tools=tools)
        terminator, _ = self.turn_terminator()
        end = e_text.find(SENTINEL) + len(SENTINEL)
        if e_text[end:end + len(terminator)] != terminator:
            return None, "the template writes no known terminator after the last assistant message"
        new_text = e_text[end + len(terminator):]
        if not b_text.endswith(new_text):
            return None, "the new messages render differently after the history"
        boundary = len(b_text) - len(new_text)
        encoding = self.tokenizer(b_text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [offset[0] for offset in encoding["offset_mapping"]]
        if encoding["input_ids"] != b_ids or boundary not in starts:
            return None, "no token boundary where the new messages start"
        return starts.index(boundary), None
