"""ChatML rendering of OpenAI-style messages with Qwen/Hermes tool calls, and the reverse parser.

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{tool json per line}\n</tools> ...<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n      (consecutive tool results share one turn)
    <|im_start|>assistant\n                                                         (generation prompt)

`render_segments` returns the same text cut per message into open / body / close parts, so a caller
can swap an earlier assistant body for the exact token ids the model produced (`encode_chat`).
Because every segment is encoded on its own, the ids of a conversation's next prompt always extend
the ids of its previous prompt plus the recorded output: prefix caches and token-in/token-out
training both rely on that. `assets/chat_template.jinja` is the same format for transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gyre_ray.json_values import finite_float, reject_constant

if TYPE_CHECKING:
    from gyre_ray.model.tokenizer import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
STOP_TEXTS = (IM_END, "<|endoftext|>")
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

SegmentKind = Literal["system", "user", "assistant", "tool", "generation_prompt"]
SegmentPart = Literal["open", "body", "close"]


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered prompt: a message's ChatML opening, its body, or its closing."""

    kind: SegmentKind
    text: str
    message_index: int | None  # None for a tools-only system turn and the generation prompt
    part: SegmentPart


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedOutput:
    """An assistant output split into text, tool calls and problems found while parsing."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str = ""


# ----------------------------------------------------------------------------- rendering
def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any, where: str = "message") -> str:
    """Plain text of a message content: a string, None, or a list of {"type": "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string, a list of text parts or null")


def tool_definition(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as {"type": "function", "function": {...}} whether given that way or bare."""
    if "function" in tool:
        return {"type": "function", "function": dict(tool["function"])}
    if "name" not in tool:
        raise ValueError(f"tool definition without a name: keys {sorted(tool)}")
    return {"type": "function", "function": dict(tool)}


def tool_call_text(call: Mapping[str, Any]) -> str:
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` for an OpenAI-style tool call."""
    function = call.get("function", call)
    name = function.get("name")
    if not name:
        raise ValueError(f"assistant tool call without a function name: {dict(call)!r}")
    arguments = function.get("arguments")
    if arguments is None:  # absent or null: an empty object, as the shipped jinja template writes it
        arguments = {}
    arguments_json = arguments if isinstance(arguments, str) else _dumps(arguments)
    return f'{TOOL_CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": {arguments_json}}}\n{TOOL_CALL_CLOSE}'


def assistant_body(message: Mapping[str, Any], index: int) -> str:
    """What the model writes for an assistant message: [<think>..</think>] content, tool calls."""
    text = content_text(message.get("content"), f"messages[{index}]")
    reasoning = message.get("reasoning_content")
    if reasoning:
        text = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{text}"
    for call in message.get("tool_calls") or []:
        text = f"{text}\n{tool_call_text(call)}" if text else tool_call_text(call)
    return text


def _tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "".join("\n" + _dumps(tool_definition(tool)) for tool in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_POSTAMBLE


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The prompt cut into segments; `"".join(s.text for s in segments)` is the full ChatML text."""
    segments: list[Segment] = []

    def turn(kind: SegmentKind, role: str, body: str, index: int | None) -> None:
        segments.append(Segment(kind, f"{IM_START}{role}\n", index, "open"))
        segments.append(Segment(kind, body, index, "body"))
        segments.append(Segment(kind, f"{IM_END}\n", index, "close"))

    first_is_system = bool(messages) and messages[0].get("role") == "system"
    if tools and not first_is_system:
        turn("system", "system", _tools_block(tools), None)
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "system":
            body = content_text(message.get("content"), f"messages[{i}]")
            if i == 0 and tools:
                body = f"{body}\n\n{_tools_block(tools)}" if body else _tools_block(tools)
            turn("system", "system", body, i)
        elif role == "user":
            turn("user", "user", content_text(message.get("content"), f"messages[{i}]"), i)
        elif role == "assistant":
            turn("assistant", "assistant", assistant_body(message, i), i)
        elif role == "tool":
            result = content_text(message.get("content"), f"messages[{i}]")
            follows_tool = i > 0 and messages[i - 1].get("role") == "tool"
            precedes_tool = i + 1 < len(messages) and messages[i + 1].get("role") == "tool"
            if not follows_tool:
                segments.append(Segment("tool", f"{IM_START}user\n", i, "open"))
            prefix = "\n" if follows_tool else ""
            segments.append(
                Segment("tool", f"{prefix}<tool_response>\n{result}\n</tool_response>", i, "body")
            )
            if not precedes_tool:
                segments.append(Segment("tool", f"{IM_END}\n", i, "close"))
        else:
            raise ValueError(
                f"messages[{i}].role is {role!r}; allowed: 'system', 'user', 'assistant', 'tool'"
            )
    if add_generation_prompt:
        segments.append(Segment("generation_prompt", f"{IM_START}assistant\n", None, "open"))
    return segments


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The whole ChatML prompt as text."""
    return "".join(s.text for s in render_segments(messages, tools, add_generation_prompt))


def tokens_at_least(chars: int, token_chars: int) -> int:
    """The fewest tokens `chars` characters of text encode to when no token spells more than
    `token_chars` of them."""
    return -(-chars // max(token_chars, 1))


class PromptTooLong(ValueError):
    """The prompt surely has at least `at_least` tokens, more than allowed: found before encoding it."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"the prompt is at least {at_least} tokens")
        self.at_least = at_least


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    assistant_tokens: Mapping[int, Sequence[int]] | None = None,
    token_limit: tuple[int, int] | None = None,
) -> list[int]:
    """Prompt ids, encoding segment by segment; `assistant_tokens[i]` replaces message i's body.

    The recorded ids are what the model produced after `<|im_start|>assistant\\n`; when they end
    with a stop id (<|im_end|> / eos) that id stands in for the closing <|im_end|>.
    `token_limit` = (limit, longest token in characters): a prompt whose text alone needs at least
    `limit` tokens (each token spells at most that many characters) raises `PromptTooLong` before
    any encoding, which for a huge prompt takes seconds that nothing else could use.
    """
    assistant_tokens = assistant_tokens or {}
    stop_ids = set(tokenizer.stop_ids())
    segments = list(render_segments(messages, tools, add_generation_prompt))
    if token_limit is not None:
        limit, token_chars = token_limit
        chars = sum(len(seg.text) for seg in segments if assistant_tokens.get(seg.message_index) is None)
        at_least = tokens_at_least(chars, token_chars)
        if at_least >= limit:
            raise PromptTooLong(at_least)
    ids: list[int] = []
    recorded_stop = False
    for seg in segments:
        recorded = assistant_tokens.get(seg.message_index) if seg.kind == "assistant" else None
        if recorded is not None and seg.part == "body":
            ids.extend(recorded)
            recorded_stop = bool(recorded) and recorded[-1] in stop_ids
        elif recorded is not None and seg.part == "close" and recorded_stop:
            ids.extend(tokenizer.encode(seg.text[len(IM_END) :]))
        elif seg.text:
            ids.extend(tokenizer.encode(seg.text))
    return ids


# ----------------------------------------------------------------------------- parsing
def _strict_json(raw: str) -> Any:
    """`json.loads` refusing NaN, Infinity and numbers out of float range (a tool call's arguments
    are echoed back to the client as JSON, which cannot hold them)."""
    return json.loads(raw, parse_constant=reject_constant, parse_float=finite_float)


def _parse_call(raw: str) -> tuple[ToolCall | None, str | None]:
    try:
        payload = _strict_json(raw)
    except json.JSONDecodeError as exc:
        return None, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"
    except (RecursionError, ValueError):  # nested past the parser's depth; a number out of range
        return None, "tool call JSON is nested too deeply or holds a number out of range"
    if not isinstance(payload, dict):
        return None, f"tool call JSON must be an object, got {type(payload).__name__}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call has no 'name' string"
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _strict_json(arguments) if arguments.strip() else {}
        except (RecursionError, ValueError):  # (json.JSONDecodeError is a ValueError)
            return None, f"tool call {name!r}: 'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"tool call {name!r}: 'arguments' must be an object, got {type(arguments).__name__}"
    return ToolCall(name, arguments), None


def parse_assistant_output(text: str) -> ParsedOutput:
    """Split generated text into content, reasoning and `<tool_call>` blocks.

    Malformed blocks (bad JSON, no name, unterminated, stray closing tag) stay in `content` as raw
    text and are described in `errors`; nothing is dropped silently. A trailing stop token is removed.
    """
    for stop in STOP_TEXTS:
        if text.endswith(stop):
            text = text[: -len(stop)]
    reasoning = ""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        inner, _, text = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
        reasoning = inner.strip()
    kept: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        stray = text.find(TOOL_CALL_CLOSE, pos, len(text) if start == -1 else start)
        while stray != -1:
            errors.append(f"'{TOOL_CALL_CLOSE}' at char {stray} without an opening '{TOOL_CALL_OPEN}'")
            stray = text.find(TOOL_CALL_CLOSE, stray + 1, len(text) if start == -1 else start)
        if start == -1:
            kept.append(text[pos:])
            break
        kept.append(text[pos:start])
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end == -1:
            errors.append(f"unterminated '{TOOL_CALL_OPEN}' at char {start}")
            kept.append(text[start:])
            break
        block_end = end + len(TOOL_CALL_CLOSE)
        call, error = _parse_call(text[start + len(TOOL_CALL_OPEN) : end].strip())
        if call is None:
            errors.append(f"block at char {start}: {error}")
            kept.append(text[start:block_end])
        else:
            calls.append(call)
        pos = block_end
    return ParsedOutput(content="".join(kept).strip(), tool_calls=calls, errors=errors, reasoning=reasoning)


# ----------------------------------------------------------------------------- HF Jinja templates
def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render an HF `chat_template` (e.g. a local Qwen folder's) the way transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(
        value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    return compiled.render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )
