"""ReasoningSplitter: a reply's text -> (reasoning, content), for `<think>…</think>` models (Qwen3, Qwen3.5,
DeepSeek-R1). Pure Python: the ingress streams through it (serve_app/reasoning.py picks who gets it) and the
replica keys a retained turn by the same split (replicas/engine/retention.py), so the two never disagree.

Where the reply starts is decided by the prompt (ThinkState):

    OPEN    the prompt ends inside <think> (Qwen3.5, R1-0528: '<think>\\n')   reasoning until </think>
    MODEL   the prompt leaves it to the model (Qwen3: 'assistant\\n')          reasoning only if the reply
                                                                             opens with <think>
    CLOSED  the prompt closed thinking ('<think>\\n\\n</think>\\n\\n')          all content, as generated

Text is the Qwen templates' canonical form, so a client that sends the parts back re-renders what the model
wrote: reasoning without its leading / trailing newlines, content without the newlines after </think>. (vLLM's
qwen3 parser keeps both; its content after Qwen's '</think>\\n\\n' starts with two newlines.) A reply that
ends before </think> is all reasoning. A <think> after the reply's start, or any tag in content, is text.
"""

from enum import Enum

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkState(str, Enum):
    OPEN = "open"
    MODEL = "model"
    CLOSED = "closed"


class Phase(Enum):
    START = 0  # before the first non-whitespace text: a <think> may still open
    REASONING = 1
    AFTER_END = 2  # just after </think>: newlines dropped
    CONTENT = 3


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Fed a reply's text deltas in order; each `feed` returns the (reasoning, content) text it can hand out
    now ("" for none), holding back only what a later delta may change (a tag split across deltas, newlines
    that may precede </think>). `finish` hands out the rest. Joined, the outputs equal `split_reasoning`."""

    def __init__(self, state: ThinkState):
        self.state = ThinkState(state)
        self.phase = Phase.CONTENT if self.state is ThinkState.CLOSED else Phase.START
        self.buffer = ""
        self.num_reasoning_chars = 0  # handed out so far: leading newlines are dropped until the first text

    def feed(self, text: str) -> tuple[str, str]:
        if self.phase is Phase.CONTENT:  # the common case after </think>: no buffering
            return "", text
        self.buffer += text
        reasoning, content = "", ""
        if self.phase is Phase.START:
            head = self.buffer.lstrip()
            if head.startswith(THINK_START):
                self.buffer, self.phase = head[len(THINK_START):], Phase.REASONING
            elif THINK_START.startswith(head):
                return "", ""  # whitespace, or a <think> still arriving
            elif self.state is ThinkState.OPEN:
                self.phase = Phase.REASONING
            else:
                self.phase, content, self.buffer = Phase.CONTENT, self.buffer, ""
                return "", content
        if self.phase is Phase.REASONING:
            reasoning = self._reasoning()
        if self.phase is Phase.AFTER_END:
            rest = self.buffer.lstrip("\n")
            if rest:
                self.phase, content, self.buffer = Phase.CONTENT, rest, ""
            else:
                self.buffer = ""
        return reasoning, content

    def _reasoning(self) -> str:
        """Reasoning text that can go out now; moves to AFTER_END at </think>."""
        if not self.num_reasoning_chars:
            self.buffer = self.buffer.lstrip("\n")
        end = self.buffer.find(THINK_END)
        if end >= 0:
            out = self.buffer[:end].rstrip("\n")
            self.buffer, self.phase = self.buffer[end + len(THINK_END):], Phase.AFTER_END
        else:
            # hold a partial '</th' and the newlines before it: both vanish if </think> completes
            body = self.buffer[:len(self.buffer) - _partial_tag(self.buffer, THINK_END)]
            out = body.rstrip("\n")
            self.buffer = self.buffer[len(out):]
        self.num_reasoning_chars += len(out)
        return out

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the reply: a reply cut inside reasoning keeps it as reasoning."""
        rest, self.buffer = self.buffer, ""
        if self.phase is Phase.START:
            if self.state is ThinkState.OPEN:
                rest = rest.lstrip("\n")
                self.num_reasoning_chars += len(rest)
                return rest, ""
            return "", rest
        if self.phase is Phase.REASONING:
            if not self.num_reasoning_chars:
                rest = rest.lstrip("\n")
            self.num_reasoning_chars += len(rest)
            return rest, ""
        return "", ""


def split_reasoning(text: str, state: ThinkState) -> tuple[str | None, str | None]:
    """-> (reasoning, content) of a whole reply; None for an empty part (and reasoning None when CLOSED)."""
    splitter = ReasoningSplitter(state)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None
