"""Hermes-format tool calls, as Qwen2.5 / Qwen3 (and Hermes 2 Pro) write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The name-first order the templates ask for streams: id and name once the header is read up to the
arguments' '{', then the arguments as the model writes them, so `arguments` is the exact JSON text the model
produced (braces and quotes inside its strings do not end it: JsonScanner). Any other
object (arguments first, "parameters" for "arguments", arguments as a JSON string) is read whole when it
closes, and its arguments are re-serialised.
"""

import json

from core.tool_calls.stream import DONE, INVALID, WAIT, ToolCallStream, after_call, match_literal, skip_ws

NAME = object()
HEADER = ("{", '"name"', ":", NAME, ",", '"arguments"', ":")


class JsonScanner:
    """Where a JSON value that opens with '{' or '[' closes; braces and quotes inside strings do not count.
    Structure only: json.loads decides validity once the value is closed."""

    def __init__(self, depth: int = 0):
        self.depth, self.in_string, self.escape = depth, False, False

    def scan(self, text: str) -> int | None:
        """Reads `text` on from where the last call stopped; the index just past the close, or None."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


def match_string(text: str, i: int) -> tuple[str, int]:
    """A JSON string at text[i:]: (DONE, end), (WAIT, i) while it is open, (INVALID, i) if none starts."""
    if text[i] != '"':
        return INVALID, i
    escape = False
    for j in range(i + 1, len(text)):
        if escape:
            escape = False
        elif text[j] == "\\":
            escape = True
        elif text[j] == '"':
            return DONE, j + 1
    return WAIT, i


def match_header(body: str) -> tuple[str, str | None, int]:
    """`{"name": "<name>", "arguments": ` followed by '{' -> (DONE, name, index of that '{');
    (WAIT, None, _) while `body` may still become one; (INVALID, None, _) when it cannot."""
    i, name = 0, None
    for piece in HEADER:
        i = skip_ws(body, i)
        if i == len(body):
            return WAIT, None, i
        if piece is NAME:
            state, end = match_string(body, i)
            if state != DONE:
                return state, None, i
            try:
                name = json.loads(body[i:end])
            except ValueError:
                return INVALID, None, i
            if not name:
                return INVALID, None, i
            i = end
        else:
            state, i = match_literal(body, i, piece)
            if state != DONE:
                return state, None, i
    i = skip_ws(body, i)
    if i == len(body):
        return WAIT, None, i
    return (DONE, name, i) if body[i] == "{" else (INVALID, None, i)


def parse_call_object(text: str) -> tuple[str, str] | None:
    """A whole call object in any key order -> (name, arguments JSON text), or None if it is not a call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolStream(ToolCallStream):
    """Phases of one call: header -> (arguments -> tail | whole object) -> after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase, self.scanner = "", JsonScanner()
        self._whole: tuple[JsonScanner, int] | None = None  # (scanner, where it stopped) of an object read whole

    def _body(self, final: bool) -> str:
        if self.call is None:
            return self._header(final)
        if self.phase == "arguments":
            end = self.scanner.scan(self.buf)
            self._arguments(self._take(len(self.buf) if end is None else end))
            if end is None:
                return WAIT
            self.call.is_valid = _is_object(self.call.arguments)
            self.phase = "tail"
        if self.phase == "tail":  # the call object's own '}'
            i = skip_ws(self.buf, 0)
            if i == len(self.buf):
                return WAIT
            if self.buf[i] == ",":  # keys after the arguments: skipped to the object's close
                self._take(i + 1)
                self.phase, self.scanner = "extra", JsonScanner(depth=1)
            elif self.buf[i] == "}":
                self._take(i + 1)
                self.phase = "after"
            else:  # the call object never closed: a broken call
                self._take(i)
                self.call.is_valid = False
                self.phase = "after"
        if self.phase == "extra":
            end = self.scanner.scan(self.buf)
            self._take(len(self.buf) if end is None else end)
            if end is None:
                return WAIT
            self.phase = "after"
        return after_call(self, final)

    def _header(self, final: bool) -> str:
        state, name, end = match_header(self.buf)
        if state == DONE:
            self._commit(name, end)
            self.phase, self.scanner = "arguments", JsonScanner()
            return self._body(final)
        if state == WAIT:
            return WAIT
        return self._whole_object(final)

    def _whole_object(self, final: bool) -> str:
        """Not the name-first header: read the object whole when it closes."""
        start = skip_ws(self.buf, 0)
        if self.buf[start:start + 1] != "{":
            return INVALID
        scanner, scanned = self._whole or (JsonScanner(), start)
        end = scanner.scan(self.buf[scanned:])
        if end is None:
            self._whole = (scanner, len(self.buf))
            return WAIT
        self._whole = None
        parsed = parse_call_object(self.buf[start:scanned + end])
        if parsed is None:
            return INVALID
        self._commit(parsed[0], scanned + end)
        self._arguments(parsed[1])
        self.phase = "after"
        return self._body(final)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
