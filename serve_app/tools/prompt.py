"""Tools and tool turns on their way into a chat template.

1. Every template gets assistant tool calls with `arguments` as an object: OpenAI clients send a JSON
   string, and Qwen's / Llama's templates write `arguments | tojson` (a string would render quoted twice).
   The same form keys retention (core.hashing.history_key), so a client that re-serialises the
   arguments with other spacing still finds its conversation. An assistant message with tool calls and no
   content gets content "" (Qwen3's and Phi-3's templates read `message.content` unguarded).
2. A template without tool support (SmolLM2's, Gemma 3's, Phi-3's: passing `tools` changes nothing) would
   drop the tools silently. Instead the tools go into a system block in the Hermes format Qwen2.5's
   template writes (the text below is its published tool prompt), assistant tool calls into their content
   as '<tool_call>' blocks, and tool results into a user turn of '<tool_response>' blocks, as Qwen2.5
   renders them; the hermes parser then reads the reply.
"""

import json

HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")
PROBE_TOOL = {"type": "function", "function": {"name": "tether_probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def template_tool_call(call: dict) -> dict:
    """An OpenAI tool call with its `arguments` as an object when they are a JSON object's text."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def assistant_message(content: str | None, tool_calls: list[dict] | None) -> dict:
    """An assistant message as templates and history keys take it (point 1 above); the one canonical form,
    for a client's message and for a reply the server parsed alike."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["content"] = content or ""
        message["tool_calls"] = [template_tool_call(c) for c in tool_calls]
    return message


def hermes_tool_prompt(tools: list[dict]) -> str:
    return HERMES_TOOL_PROMPT.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_call_text(call: dict) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": {arguments}}}' \
           "\n</tool_call>"


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages for a template without tool support (point 2 above)."""
    out: list[dict] = []
    after_tool = False  # the last message out holds tool results: a next one merges into it
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            content = message.get("content") or ""
            calls = "\n".join(hermes_call_text(c) for c in message["tool_calls"])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            text = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if after_tool:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                continue
            message = {"role": "user", "content": text}
        elif role == "user" and after_tool:  # strict templates need user / assistant to alternate
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + (message.get("content") or "")}
            after_tool = False
            continue
        out.append(message)
        after_tool = role == "tool"
    if tools:
        block = hermes_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
