"""ReasoningParser: which chat replies get split into reasoning and content, and where each reply starts.

`ingress.reasoning_parser` decides for the deployment: "auto" (on when the chat template writes `<think>`),
"think" (on), "none" (off: the reply is all content, as generated). When on, each chat request's prompt gives
the ThinkState its reply starts in (core/reasoning.py); the state travels to the replica in
GenerateRequest.reasoning (the retained turn is keyed by the split the client received) and drives the
response's ReasoningSplitter (serve_app/responses.py). Completions are never split.

The grammar of a structured-output request must not constrain the reasoning: `start_after` names the ids
after which it starts.
"""

from core.reasoning import THINK_END, THINK_START, ReasoningSplitter, ThinkState, split_reasoning

__all__ = ["ReasoningParser", "ReasoningSplitter", "ThinkState", "split", "split_reasoning"]

MODES = ("auto", "think", "none")
TAIL_TOKENS = 32  # generation prompts end within this many tokens ('<|im_start|>assistant\n<think>\n\n</think>\n\n': 7)


def split(text: str, state: ThinkState = ThinkState.MODEL) -> tuple[str | None, str | None]:
    return split_reasoning(text, state)


def template_thinks(chat_template) -> bool:
    """A template that writes <think> (Qwen3, Qwen3.5, DeepSeek-R1); a dict of named templates counts if any does."""
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any(THINK_START in str(text) for text in texts)


def prompt_state(prompt_text: str, continued: bool = False) -> ThinkState:
    """Where a reply to `prompt_text` starts. A generation prompt decides by how it ends (open, closed, or no
    tag), so a `<think>` quoted in a user message is no tag. A continued final message may end inside its own
    reasoning: there the last tag of the whole prompt decides."""
    if continued:
        return ThinkState.OPEN if prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END) else \
            ThinkState.MODEL
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_START):
        return ThinkState.OPEN
    if tail.endswith(THINK_END):
        return ThinkState.CLOSED
    return ThinkState.MODEL


class ReasoningParser:
    def __init__(self, mode: str, tokenizer):
        if mode not in MODES:
            raise ValueError(f"reasoning_parser must be one of {MODES}, got {mode!r}")
        self.tokenizer = tokenizer
        self.is_enabled = mode == "think" or mode == "auto" and template_thinks(
            getattr(tokenizer, "chat_template", None))
        self._end_ids: list[int] | None = None

    def state(self, prompt_token_ids: list[int], continued: bool = False) -> ThinkState | None:
        """The ThinkState of a chat prompt (its rendered ids); None when this deployment does not split."""
        if not self.is_enabled:
            return None
        ids = prompt_token_ids if continued else prompt_token_ids[-TAIL_TOKENS:]
        return prompt_state(self.tokenizer.decode(ids, skip_special_tokens=False), continued)

    def end_ids(self) -> list[int]:
        """The ids of </think> (one where the vocabulary has it as a token)."""
        if self._end_ids is None:
            self._end_ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)
        return self._end_ids

    def start_after(self, state: ThinkState | None) -> list[int] | None:
        """For a grammar (structured outputs, tool enforcement): the ids after which it starts, or None to start
        at the first token. A reply that starts inside reasoning, or may open it (MODEL: Qwen3's template
        leaves <think> to the model), is free until </think>; one whose prompt closed thinking is not."""
        if state is None or state is ThinkState.CLOSED:
            return None
        return list(self.end_ids())

    def grammar_start_after(self, prompt_token_ids: list[int], continued: bool = False) -> list[int] | None:
        """`start_after` straight from the rendered prompt ids."""
        return self.start_after(self.state(prompt_token_ids, continued))
