"""ToolCallReader: how one request's replies are read for tool calls, and which parser a model gets.

`ingress.tool_parser` names the format ("hermes", "qwen3_xml"); "auto" reads it off the chat template:
'<function=' (Qwen3.5, Qwen3-Coder) -> qwen3_xml; otherwise hermes ('<tool_call>' with JSON: Qwen2.5,
Qwen3, Hermes; and a template without tool support, which gets serve_app/tools/prompt.py's Hermes block).
"""

from dataclasses import dataclass

from core.tool_calls.hermes import HermesToolStream
from core.tool_calls.qwen3_xml import Qwen3XmlToolStream
from core.tool_calls.stream import ToolCallStream

PARSERS: dict[str, type[ToolCallStream]] = {"hermes": HermesToolStream, "qwen3_xml": Qwen3XmlToolStream}


def choose_parser(setting: str, chat_template: str | dict | None, supports_tools: bool) -> str:
    if setting != "auto":
        return setting
    if not supports_tools or not chat_template:
        return "hermes"
    text = chat_template if isinstance(chat_template, str) else "\n".join(map(str, chat_template.values()))
    return "qwen3_xml" if "<function=" in text else "hermes"


@dataclass(frozen=True)
class ToolCallReader:
    """Made per request when it has tools and tool_choice is not "none"; one stream per choice."""

    parser: str
    tools: list[dict]
    parallel_tool_calls: bool = True

    def stream(self) -> ToolCallStream:
        return PARSERS[self.parser](self.tools, max_calls=None if self.parallel_tool_calls else 1)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply -> (content, or None when calls came without any; message.tool_calls)."""
        return self.stream().parse(text)

    @staticmethod
    def finish_reason(reason: str | None, has_calls: bool) -> str | None:
        """A reply that ended by itself with calls ends in "tool_calls"; "length" stays (a call may be cut)."""
        return "tool_calls" if has_calls and reason == "stop" else reason
