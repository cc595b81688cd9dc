"""Anthropic request bodies (`/v1/messages`, `/v1/messages/count_tokens`) and their translation to a prompt.

Accepts what Claude Code sends: `system` as a string or text blocks, a `system` message in the middle of
`messages`, `cache_control` on blocks, `thinking` blocks in assistant turns (dropped: the policy cannot
honour them), and top-level fields such as `thinking`, `context_management`, `output_config`,
`metadata` (ignored, except `metadata.user_id`'s session id, which is recorded). Blocks the policy
cannot read (image, document, search_result, ...) and `top_k` are a 400 naming them;
`tool_choice.disable_parallel_tool_use` stops generation once the first tool call is closed.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gyre_ray.proxy.errors import bad_request
from gyre_ray.proxy.openai_schema import Lenient, NameText, StopString, session_or_none
from gyre_ray.proxy.prompt import ChatPrompt, check_parameters_schema, check_tool_name


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(Lenient):
    type: Literal["image", "document"]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(Lenient):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("input_schema")
    @classmethod
    def _check_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_parameters_schema(value)

    @model_validator(mode="after")
    def _custom_needs_schema(self) -> Tool:
        if self.type in (None, "custom") and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


_USER_ID_MAX_CHARS = 4096
BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")
RESULT_BLOCK_TYPES = ("text", "image", "document")


class CountTokensRequest(Lenient):
    model: NameText
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_blocks_only(cls, data: Any) -> Any:
        """A block type the proxy does not know (search_result, server tool blocks, ...) is a clear 400
        rather than a long discriminator error."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, msg in enumerate(messages if isinstance(messages, list) else []):
            content = msg.get("content") if isinstance(msg, dict) else None
            for j, block in enumerate(content if isinstance(content, list) else []):
                kind = block.get("type") if isinstance(block, dict) else None
                _check_block_type(kind, BLOCK_TYPES, f"messages.{i}.content.{j}")
                inner = block.get("content") if kind == "tool_result" else None
                for k, item in enumerate(inner if isinstance(inner, list) else []):
                    inner_kind = item.get("type") if isinstance(item, dict) else None
                    _check_block_type(inner_kind, RESULT_BLOCK_TYPES, f"messages.{i}.content.{j}.content.{k}")
        return data

    def parallel_tool_calls(self) -> bool | None:
        """False when `tool_choice.disable_parallel_tool_use` asks for at most one tool call."""
        choice = self.tool_choice
        return False if choice is not None and choice.disable_parallel_tool_use else None

    def to_prompt(self) -> ChatPrompt:
        """The conversation as OpenAI-style messages (tool_use -> tool_calls, tool_result -> tool)."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": _join_text(self.system)})
        for i, msg in enumerate(self.messages):
            messages.extend(_convert(msg, i))
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
            if t.input_schema is not None  # server tools (web search ...) are not the policy's to call
        ]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tools: tool names must be unique", "tools")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise bad_request(f"tool_choice {choice.type!r} needs tools to choose from", "tool_choice")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise bad_request(
                f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice"
            )
        parse = bool(tools) and (choice is None or choice.type != "none")
        return ChatPrompt(messages=messages, tools=tools, parse_tools=parse)

    def session_id(self) -> str | None:
        """Claude Code's `metadata.user_id` is a JSON string holding a `session_id`; None otherwise."""
        meta = (self.model_extra or {}).get("metadata")
        raw = meta.get("user_id") if isinstance(meta, dict) else None
        if not isinstance(raw, str) or len(raw) > _USER_ID_MAX_CHARS:  # (none is anywhere near)
            return None
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's limit: not Claude Code's
            marker = "_session_"
            value = raw.split(marker, 1)[1] if marker in raw else None
        else:
            value = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session_or_none(value)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[StopString], Field(max_length=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False

    def model_post_init(self, _context: Any) -> None:
        if self.top_k is not None:
            raise bad_request(
                "top_k is not supported: the policy samples with temperature and top_p only", "top_k"
            )


def _check_block_type(kind: Any, known: tuple[str, ...], where: str) -> None:
    if isinstance(kind, str) and kind not in known:
        raise bad_request(f"{where}: {kind} blocks are not supported by this text-only policy", where)


def _join_text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _unsupported(kind: str, where: str) -> Exception:
    return bad_request(f"{where}: {kind} blocks are not supported by this text-only policy", where)


def _convert(msg: Message, index: int) -> list[dict[str, Any]]:
    where = f"messages.{index}.content"
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if msg.role == "system":
        texts = []
        for block in msg.content:
            if not isinstance(block, TextBlock):
                raise bad_request(f"{where}: a system message may hold only text blocks", where)
            texts.append(block.text)
        return [{"role": "system", "content": "\n".join(texts)}]
    if msg.role == "assistant":
        texts, calls = [], []
        for block in msg.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ImageBlock):
                raise _unsupported(block.type, where)
            elif isinstance(block, ToolResultBlock):
                raise bad_request(f"{where}: tool_result blocks belong in user messages", where)
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in msg.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _tool_result_text(block, where),
                }
            )
        elif isinstance(block, ImageBlock):
            raise _unsupported(block.type, where)
        elif isinstance(block, ToolUseBlock):
            raise bad_request(f"{where}: tool_use blocks belong in assistant messages", where)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for item in content:
        if not isinstance(item, TextBlock):
            raise _unsupported(item.type, where)
        texts.append(item.text)
    return "\n".join(texts)
