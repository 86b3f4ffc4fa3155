"""What `tool_choice: "required"` or a named function must generate, as plain data for the grammar stage.

The result is an xgrammar structural tag (`xgrammar.Grammar.from_structural_tag(spec)` compiles it), built
from the same tags the parsers read (hermes.py, qwen3_xml.py), so the grammar and the parser never
disagree on the format (the failure behind vllm#44447: `required` answering an empty tool_calls):

    hermes     <tool_call>\\n{"name": "NAME", "arguments": <NAME's parameters schema>}\\n</tool_call>
    qwen3_xml  <tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n...</function>\\n</tool_call>

named     exactly one call of that function;
required  one or more calls of any tool, separated by '\\n' (exactly one with parallel_tool_calls false).
The reply is the call(s) and nothing else (no content); the model's stop token ends it. Reasoning: where
the reply starts inside <think> the grammar stage starts after '</think>' (StructuredSpec.start_after); where
the model may or may not open it (Qwen3's template), `optional_reasoning` lets the tag allow one free
'<think>...</think>' block first (a start_after there would wait for a '</think>' that may never come).
"""

import json

from core.reasoning import THINK_END, THINK_START
from core.tool_calls.stream import END, START

OBJECT = {"type": "object", "properties": {}}
# At most one whitespace character in a row inside the arguments JSON: the templates' own form
# ({"city": "Paris"}), and a small or uncertain model cannot loop on whitespace until max_tokens.
MAX_WHITESPACE = 1


def parameters_schema(function: dict) -> dict:
    return function.get("parameters") or OBJECT


def call_tag(function: dict, parser: str) -> dict:
    """One call of `function` in the parser's format: begin, the arguments schema, end."""
    name = function["name"]
    if parser == "qwen3_xml":
        return {"type": "tag", "begin": f"{START}\n<function={name}>\n",
                "content": {"type": "json_schema", "json_schema": parameters_schema(function), "style": "qwen_xml"},
                "end": f"</function>\n{END}"}
    return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters_schema(function),
                        "max_whitespace_cnt": MAX_WHITESPACE},
            "end": f"}}\n{END}"}


def tool_call_structural_tag(tools: list[dict], tool_choice, parser: str, parallel_tool_calls: bool = True,
                             optional_reasoning: bool = False) -> dict | None:
    """The structural tag for `tool_choice` "required" or {"type": "function", "function": {"name": X}};
    None for "auto" / "none" / no tools (nothing to enforce). `tools` are validated OpenAI tools."""
    functions = {t["function"]["name"]: t["function"] for t in tools or []}
    if isinstance(tool_choice, dict):
        fmt = call_tag(functions[tool_choice["function"]["name"]], parser)
    elif tool_choice == "required" and functions:
        fmt = {"type": "tags_with_separator", "tags": [call_tag(f, parser) for f in functions.values()],
               "separator": "\n", "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    else:
        return None
    if optional_reasoning:
        think = {"type": "tag", "begin": THINK_START, "content": {"type": "any_text"}, "end": THINK_END}
        fmt = {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "sequence", "elements": [
                think, {"type": "regex", "pattern": r"\s*"}]}}, fmt]}
    return {"type": "structural_tag", "format": fmt}
