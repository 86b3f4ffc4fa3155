"""Tool calling in the ingress: tools into the prompt (prompt.py), calls out of the reply (the parsers live in
core/tool_calls/: the replica runs the same ones to key a finished tool turn for retention), and the
grammar `tool_choice` "required" or a named function needs (grammar.py). Pure functions over text; no model,
no Ray."""

from core.tool_calls.reader import PARSERS, ToolCallReader, choose_parser
from core.tool_calls.stream import StreamDelta, ToolCallStream
from serve_app.tools.grammar import tool_call_structural_tag
from serve_app.tools.prompt import assistant_message, hermes_messages, template_tool_call, uses_tools

__all__ = ["PARSERS", "StreamDelta", "ToolCallReader", "ToolCallStream", "assistant_message", "choose_parser",
           "hermes_messages", "template_tool_call", "tool_call_structural_tag", "uses_tools"]
