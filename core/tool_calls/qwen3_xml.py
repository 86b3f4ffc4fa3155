"""Qwen3.5 / Qwen3-Coder tool calls, the XML form their templates ask for:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text becomes a JSON value by the tool's parameters schema: "string" stays text; other types
(numbers, booleans, objects, arrays) are read as JSON (Python's True / False / None too: the template
writes non-JSON scalars with Jinja's `string`); a parameter the schema does not know stays text.
Streaming: id and name once '<function=NAME>' is read, then each parameter when it closes, as
`{"p": v` / `, "q": w`, and '}' at '</function>'; `arguments` is the JSON object those pieces spell.
"""

import json

from core.tool_calls.stream import DONE, INVALID, WAIT, ToolCallStream, after_call, match_literal, skip_ws

FUNCTION, PARAMETER = "<function=", "<parameter="
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"
PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def parameter_value(text: str, schema: dict | None):
    """A parameter's text as the JSON value the schema asks for (text when in doubt)."""
    if schema is None or schema.get("type") == "string":
        return text
    if text.strip() in PYTHON_LITERALS:
        return PYTHON_LITERALS[text.strip()]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tag_name(buf: str, i: int, tag: str) -> tuple[str, str | None, int]:
    """'<tag=NAME>' at buf[i:] -> (DONE, NAME, end); WAIT while it may still be one; INVALID otherwise."""
    state, j = match_literal(buf, i, tag)
    if state != DONE:
        return state, None, i
    close = buf.find(">", j)
    name_end = close if close >= 0 else len(buf)
    if any(ch in "<\n" for ch in buf[j:name_end]):
        return INVALID, None, i
    if close < 0:
        return WAIT, None, i
    return (DONE, buf[j:close], close + 1) if close > j else (INVALID, None, i)


class Qwen3XmlToolStream(ToolCallStream):
    """Phases of one call: header -> parameters -> after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase, self.num_parameters = "", 0

    def _body(self, final: bool) -> str:
        if self.call is None:
            state, name, end = _tag_name(self.buf, skip_ws(self.buf, 0), FUNCTION)
            if state != DONE:
                return state
            self._commit(name, end)
            self.num_parameters = 0
            self.phase = "parameters"
        while self.phase == "parameters":
            step = self._parameter()
            if step != DONE:
                return step
        return after_call(self, final)

    def _parameter(self) -> str:
        """One '<parameter=P>...</parameter>' or the '</function>' that ends them; DONE after either."""
        i = skip_ws(self.buf, 0)
        if i == len(self.buf):
            return WAIT
        state, end = match_literal(self.buf, i, FUNCTION_END)
        if state == DONE:
            self._take(end)
            self._arguments("}" if self.num_parameters else "{}")
            self.phase = "after"
            return DONE
        p_state, name, value_start = _tag_name(self.buf, i, PARAMETER)
        if p_state == INVALID and state == INVALID:  # text that is neither: a broken call
            self.call.is_valid = False
            return INVALID
        if p_state != DONE:
            return WAIT
        close = self.buf.find(PARAMETER_END, value_start)
        if close < 0:
            return WAIT
        text = self.buf[value_start:close]
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        schema = (self.tools.get(self.call.name, {}).get("parameters") or {}).get("properties", {}).get(name)
        piece = json.dumps(name, ensure_ascii=False) + ": " + json.dumps(parameter_value(text, schema),
                                                                           ensure_ascii=False)
        self._take(close + len(PARAMETER_END))
        self._arguments(("{" if not self.num_parameters else ", ") + piece)
        self.num_parameters += 1
        return DONE
