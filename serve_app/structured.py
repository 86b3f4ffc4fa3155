"""The two request fields that ask for structured output, as one StructuredSpec for the replica.

    response_format     {"type": "text"}                                   -> None
                        {"type": "json_object"}                            -> json_object (schema {"type": "object"})
                        {"type": "json_schema", "json_schema": {name, schema, strict?, description?}}
                                                                           -> json_schema
                        {"type": "structural_tag", "format": {...}}        -> structural_tag (xgrammar's format)
    structured_outputs  exactly one of json (schema, object or JSON text) | json_object (true) | regex |
                        choice (list of strings) | grammar (EBNF) | structural_tag (vLLM's extra body field)

Only the shape is checked here (pure Python; the ingress imports no torch, and xgrammar does): a schema,
pattern or grammar that does not compile is refused by the replica, which compiles it before the first
delta, with a 400 naming the same field. A bad shape raises SpecError naming the field (the request's
own field; the message names the part inside it).
"""

import dataclasses
import json
import re
from typing import Any

from core.messages import StructuredSpec
from core.reasoning import THINK_END, THINK_START, ThinkState

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
STRUCTURED_OUTPUT_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class SpecError(ValueError):
    """A structured-output field of the wrong shape, naming the field (protocol.py reports it as a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def response_format_spec(value: dict[str, Any] | None) -> StructuredSpec | None:
    """OpenAI's response_format. None / text: no constraint."""
    if not value:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise SpecError("response_format", f"type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", param="response_format")
    if kind == "structural_tag":
        return StructuredSpec("structural_tag", json.dumps(value), param="response_format")
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise SpecError("response_format", "json_schema must be an object with `name` and `schema`")
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise SpecError("response_format", "json_schema.schema must be a JSON schema (an object)")
    return StructuredSpec("json_schema", json.dumps(schema), param="response_format")


def structured_outputs_spec(value: dict[str, Any] | None) -> StructuredSpec | None:
    """vLLM's structured_outputs extra field: exactly one constraint."""
    if not value:
        return None
    unknown = [k for k in value if k not in STRUCTURED_OUTPUT_KEYS]
    if unknown:
        raise SpecError("structured_outputs", f"{unknown[0]} is not supported; give one of "
                                              f"{', '.join(STRUCTURED_OUTPUT_KEYS)}")
    given = [k for k in STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise SpecError("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}; "
                                              f"got {len(given)}")
    key = given[0]
    item = value[key]
    if key == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError as exc:
                raise SpecError("structured_outputs", f"json is not valid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise SpecError("structured_outputs", "json must be a JSON schema (an object)")
        return StructuredSpec("json_schema", json.dumps(item), param="structured_outputs")
    if key == "json_object":
        if item is not True:
            raise SpecError("structured_outputs", "json_object must be true")
        return StructuredSpec("json_object", param="structured_outputs")
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) and c for c in item):
            raise SpecError("structured_outputs", "choice must be a non-empty list of non-empty strings")
        return StructuredSpec("choice", choices=list(item), param="structured_outputs")
    if key == "structural_tag":
        if isinstance(item, dict):
            item = json.dumps(item)
        if not isinstance(item, str):
            raise SpecError("structured_outputs", "structural_tag must be an object or its JSON text")
        return StructuredSpec("structural_tag", item, param="structured_outputs")
    if not isinstance(item, str) or not item:
        raise SpecError("structured_outputs", f"{key} must be a non-empty string")
    return StructuredSpec(key, item, param="structured_outputs")  # regex | grammar


def structured_spec(response_format: dict[str, Any] | None,
                    structured_outputs: dict[str, Any] | None) -> StructuredSpec | None:
    """The request's one constraint; both fields at once is refused (which would win is not obvious)."""
    from_format = response_format_spec(response_format)
    from_extra = structured_outputs_spec(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise SpecError("structured_outputs", "give response_format or structured_outputs, not both")
    return from_format or from_extra


def after_reasoning(spec: StructuredSpec, think: ThinkState | None, end_ids: list[int]) -> StructuredSpec:
    """The spec for a chat reply that may reason first (serve_app/reasoning.py's ThinkState): the constraint
    holds for the answer, never for the reasoning.
    - CLOSED or no split: as is, from the first token;
    - OPEN (the prompt opened <think>, Qwen3.5): free until </think> (start_after its ids);
    - MODEL (the model may open <think> or not, Qwen3): one optional free <think>...</think> block, then the
      constraint, as one structural tag (a start_after would wait for a </think> that may never come).
    Tool enforcement (param "tool_choice") builds its own tag (serve_app/tools/grammar.py): as is."""
    if think is None or think is ThinkState.CLOSED or spec.param == "tool_choice":
        return spec
    if think is ThinkState.OPEN:
        return dataclasses.replace(spec, start_after=list(end_ids))
    think_block = {"type": "tag", "begin": THINK_START, "content": {"type": "any_text"}, "end": THINK_END}
    reasoning = {"type": "optional", "content": {"type": "sequence", "elements": [
        think_block, {"type": "regex", "pattern": r"\s*"}]}}
    fmt = {"type": "sequence", "elements": [reasoning, _tag_content(spec)]}
    return dataclasses.replace(spec, kind="structural_tag", choices=[],
                               text=json.dumps({"type": "structural_tag", "format": fmt}))


def _tag_content(spec: StructuredSpec) -> dict:
    """A spec as a structural tag's content."""
    if spec.kind in ("json_schema", "json_object"):
        schema = json.loads(spec.text) if spec.kind == "json_schema" else {"type": "object"}
        content = {"type": "json_schema", "json_schema": schema}
        return content if spec.any_whitespace else {**content, "max_whitespace_cnt": 1}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.text}
    if spec.kind == "choice":
        return {"type": "regex", "pattern": "|".join(f"({re.escape(c)})" for c in spec.choices)}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.text}
    return json.loads(spec.text)["format"]  # structural_tag
