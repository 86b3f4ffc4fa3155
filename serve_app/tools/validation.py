"""`tools` and `tool_choice` checked as OpenAI checks them; each failure is a ValueError whose message
names the part at fault (`tools[1].function.parameters`), turned into a 400 by serve_app/protocol.py.

jsonschema comes with Ray (a dependency of ray itself), so a malformed parameters schema is caught here,
before any grammar is compiled."""

import re

from jsonschema import SchemaError
from jsonschema.validators import validator_for

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's [a-zA-Z0-9_-]{1,64}, and dots (MCP-style names)


def check_tools(tools: list) -> list:
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'; got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if function.get("parameters") is not None:
            check_parameters(function["parameters"], f"{where}.function.parameters")
    return tools


def check_parameters(schema, where: str) -> None:
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ValueError(f"{where} must be a JSON schema of an object")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON schema: {exc.message}") from None


def check_tool_choice(choice, tools: list | None) -> None:
    """none / auto / required / {"type": "function", "function": {"name": <one of tools>}}."""
    if choice in (None, "none"):
        return
    if not tools:
        raise ValueError("tool_choice needs tools")
    if choice in ("auto", "required"):
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
