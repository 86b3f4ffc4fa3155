"""ToolCallStream: a model's reply text, delta by delta, split into content and OpenAI tool-call fragments.

Both formats (hermes.py, qwen3_xml.py) wrap each call in <tool_call> ... </tool_call>; this class scans for
the tags and leaves a call's body to the format. Per reply:

    text   'Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>'
    out    content 'Sure.'
           tool_calls[0] {index 0, id, type, function {name 'f', arguments ''}}   (once the name is known)
                         {index 0, function {arguments '{"a": 1}'}}                (as the arguments arrive)

Contract (tests/unit/test_tool_parsers.py checks it at every split of the text):
- what a delta cannot decide yet is held back: a tail that may start '<tool_call>', trailing whitespace
  (whitespace right before a call, and after the last call at the end, is not content);
- a call commits once its header (the name) parsed; before that, text that only looks like a call goes
  back to content and is scanned again;
- `parse(text)` is this machine over the whole text, so streamed and not streamed agree; only a call that
  commits and then breaks (cut by max_tokens, malformed arguments) differs: the stream already sent its
  fragments, the non-streamed reply keeps its raw text as content.
"""

import secrets
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
WAIT, INVALID, DONE = "wait", "invalid", "done"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class StreamDelta:
    """What one text delta became: content text and tool-call fragments (OpenAI's delta.tool_calls)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def fragment(self, index: int, part: dict) -> None:
        """Adds a fragment, merged into this delta's previous one for the same call (one entry per call)."""
        if self.tool_calls and self.tool_calls[-1]["index"] == index:
            last = self.tool_calls[-1]
            last["function"]["arguments"] = last["function"].get("arguments", "") + part["function"]["arguments"]
        else:
            self.tool_calls.append({"index": index, **part})

    def __iadd__(self, other: "StreamDelta") -> "StreamDelta":
        self.content += other.content
        for part in other.tool_calls:
            self.fragment(part["index"], {k: v for k, v in part.items() if k != "index"})
        return self


@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    raw: str = ""  # everything this call consumed, from the whitespace before its tag on
    is_valid: bool = True
    is_complete: bool = False
    is_kept: bool = True  # False past the `parallel_tool_calls: false` limit: consumed, never shown


class ToolCallStream:
    """feed(text) -> StreamDelta per text delta; finish() at the end. Subclasses parse a call's body:
    `_body(final) -> WAIT | INVALID | DONE` over `self.buf` (the text after '<tool_call>'), with `_commit`,
    `_take` and `_arguments`."""

    def __init__(self, tools: list[dict] | None = None, max_calls: int | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.max_calls = max_calls
        self.buf = ""
        self.held = ""  # trailing whitespace of the content, not sent yet
        self.events: list[str | Call] = []  # content pieces and calls, in order: what parse() folds
        self.call: Call | None = None  # the call being read (committed or not)
        self.in_call = False
        self.num_calls = 0  # committed calls
        self._last_was_call = False
        self._out = StreamDelta()

    # -- the public interface --------------------------------------------------

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> StreamDelta:
        out = self._run(final=True)
        held, self.held = self.held, ""
        if held and not self._last_was_call:
            self._content(held, out, hold=False)
        return out

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply -> (content or None, OpenAI message.tool_calls). A call that broke after it
        committed (cut, malformed) is content here, as its raw text."""
        self.feed(text)
        self.finish()
        content, calls = "", []
        for event in self.events:
            if isinstance(event, str):
                content += event
            elif event.is_kept and event.is_valid and event.is_complete:
                calls.append({"id": event.id, "type": "function",
                              "function": {"name": event.name, "arguments": event.arguments}})
            elif event.is_kept:
                content += event.raw
        return (content or None) if calls else content, calls

    @property
    def has_calls(self) -> bool:
        """A call went out in the stream (its finish_reason becomes "tool_calls")."""
        return any(isinstance(e, Call) and e.is_kept for e in self.events)

    # -- the scan ----------------------------------------------------------------

    def _run(self, final: bool) -> StreamDelta:
        self._out = out = StreamDelta()
        while True:
            if not self.in_call:
                i = self.buf.find(START)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buf, START)
                    self._content(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._content(self.buf[:i], out)
                self.buf = self.buf[i + len(START):]
                self.in_call, self.call = True, None
                continue
            step = self._body(final)
            if step == WAIT and not final:
                return out
            if step == WAIT and self.call is not None:  # the reply ended inside a committed call
                self._take(len(self.buf))
                self._end_call(complete=False)
                self.in_call = False
                return out
            if step != DONE and self.call is None:  # never committed: the tag was text
                self._content(START, out)
            elif step == INVALID:  # committed, then broke: the rest is content again
                self._end_call(complete=True, valid=False)
            else:
                self._end_call(complete=True)
            self.in_call = False

    def _content(self, text: str, out: StreamDelta, hold: bool = True) -> None:
        text = self.held + text
        sent = text.rstrip() if hold else text
        self.held = text[len(sent):]
        if sent:
            out.content += sent
            self.events.append(sent)
            self._last_was_call = False

    def _commit(self, name: str, consumed: int) -> None:
        """The header parsed: the call is one, its id and name go out, and the header text is consumed."""
        index = self.num_calls
        self.call = Call(index, new_call_id(), name, raw=self.held + START)
        self.call.is_kept = self.max_calls is None or index < self.max_calls
        self.held = ""
        self.num_calls += 1
        self.events.append(self.call)
        self._last_was_call = True
        self._take(consumed)
        if self.call.is_kept:
            self._out.fragment(index, {"id": self.call.id, "type": "function",
                                       "function": {"name": name, "arguments": ""}})

    def _take(self, n: int) -> str:
        text, self.buf = self.buf[:n], self.buf[n:]
        if self.call is not None:
            self.call.raw += text
        return text

    def _arguments(self, text: str) -> None:
        if not text:
            return
        self.call.arguments += text
        if self.call.is_kept:
            self._out.fragment(self.call.index, {"function": {"arguments": text}})

    def _end_call(self, complete: bool, valid: bool = True) -> None:
        self.call.is_complete, self.call.is_valid = complete, self.call.is_valid and valid
        self.call = None

    def _body(self, final: bool) -> str:
        raise NotImplementedError


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (held until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def match_literal(text: str, i: int, literal: str) -> tuple[str, int]:
    """(DONE, end) if `literal` is at text[i:], (WAIT, i) if text ends inside it, (INVALID, i) otherwise."""
    if text.startswith(literal, i):
        return DONE, i + len(literal)
    return (WAIT if literal.startswith(text[i:]) else INVALID), i


def after_call(stream: ToolCallStream, final: bool) -> str:
    """After a call's body: whitespace, then '</tool_call>' (optional: anything else ends the call too)."""
    buf = stream.buf
    i = skip_ws(buf, 0)
    if i == len(buf):
        if not final:
            return WAIT
        stream._take(i)
        return DONE
    state, end = match_literal(buf, i, END)
    if state == WAIT and not final:
        return WAIT
    stream._take(end if state == DONE else i)
    return DONE
