"""The API-neutral form of a model call: OpenAI-style messages plus tool specs, and shared validators.

Both the OpenAI and the Anthropic front ends translate their request bodies into a `ChatPrompt`
(messages with `role`, `content`, optional `tool_calls` / `tool_call_id`; tools as OpenAI function
specs), which the chat template renders. `assistant_key` names an assistant turn by what the client
saw of it, so a re-sent turn can be matched to the recorded output that produced it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
JSON_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@dataclass
class ChatPrompt:
    """A conversation ready for the chat template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    parse_tools: bool = True  # False when tool_choice is "none": tool-call markup stays text


def check_tool_name(name: str) -> str:
    """Tool names: 1-128 characters of letters, digits, `_ . : -`."""
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r} must match {TOOL_NAME.pattern}")
    return name


def check_parameters_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's parameter schema must be a JSON-schema object (type "object", properties a mapping)."""
    if schema is None:
        return None
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f'a tool\'s parameter schema must have "type": "object", got {kind!r}')
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError('"properties" of a tool schema must be an object')
    for name, sub in props.items():
        if not isinstance(sub, dict):
            raise ValueError(f"property {name!r} of a tool schema must be a schema object")
        sub_type = sub.get("type")
        types = sub_type if isinstance(sub_type, list) else [sub_type] if sub_type is not None else []
        bad = [t for t in types if not isinstance(t, str) or t not in JSON_SCHEMA_TYPES]
        if bad:
            raise ValueError(f"property {name!r} has unknown JSON-schema type {bad[0]!r}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError('"required" of a tool schema must be a list of property names')
    return schema


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments in a formatting-independent form (parsed JSON re-dumped with sorted keys)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (nested past Python's limit: compared as text)
            return arguments.strip()
    try:
        return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):
        return repr(arguments)


def assistant_key(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """A key for an assistant turn: its stripped text and its (name, canonical arguments) tool calls."""
    calls = [
        [call["function"]["name"], canonical_arguments(call["function"].get("arguments", ""))]
        for call in tool_calls or []
    ]
    return json.dumps([(content or "").strip(), calls], ensure_ascii=False)


def format_validation_error(err: ValidationError, limit: int = 3) -> tuple[str, str | None]:
    """A short message naming the offending field(s) of a request body, and the first field's path."""
    parts: list[str] = []
    first_param: str | None = None
    seen: set[str] = set()
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"] if _is_field_part(p))
        if first_param is None:
            first_param = path or None
        text = f"{path or 'body'}: {item['msg']}"
        if item["type"] in ("missing",):
            text = f"{path}: field required"
        if text not in seen:
            seen.add(text)
            parts.append(text)
        if len(parts) >= limit:
            break
    return "invalid request: " + "; ".join(parts), first_param


def _is_field_part(part: Any) -> bool:
    """Drop pydantic's union / tag markers (e.g. `list[TextPart]`, `str`) from an error location."""
    if isinstance(part, int):
        return True
    return isinstance(part, str) and "[" not in part and part not in ("str", "int", "float", "bool", "dict")
