"""OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) and their translation to a prompt.

Known fields are type-checked strictly (a string where a number belongs is a 400, not a coercion);
unknown fields are accepted and ignored, as harnesses send many the policy cannot honour.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gyre_ray.proxy.errors import bad_request
from gyre_ray.proxy.prompt import ChatPrompt, check_parameters_schema, check_tool_name

_NO_LOGPROBS = (
    "log-probs are not returned to clients: the proxy records each generated token's log-prob "
    "(GET /gyre/executions/ID/records, admin)"
)
_SEED = Field(None, ge=-(1 << 63), le=(1 << 63) - 1, description="Sampling seed.")


class Lenient(BaseModel):
    """Strict types for known fields; unknown fields allowed (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionSpec(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("parameters")
    @classmethod
    def _check_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_parameters_schema(value)


class ToolSpec(Lenient):
    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(Lenient):
    name: str
    arguments: str


class ToolCallIn(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


# A stop string's longest length: the streamed text is held back by the longest suffix that may
# start one, which is searched for on every batch of tokens (a 100,000-character stop string made
# that quadratic in the output and stalled the replica's other calls for minutes).
STOP_STRING_MAX_CHARS = 256
StopString = Annotated[str, Field(max_length=STOP_STRING_MAX_CHARS)]
NameText = Annotated[str, Field(max_length=256)]  # a model name or client id, copied into every record
SESSION_MAX_CHARS = 256


def session_or_none(value: object) -> str | None:
    """A harness's session id as recorded with each call, or None: not a string, empty or longer
    than `SESSION_MAX_CHARS` (an id, not a payload: it is copied into every record of the session)."""
    return value if isinstance(value, str) and 0 < len(value) <= SESSION_MAX_CHARS else None


class SamplingFields(Lenient):
    """Fields shared by chat and text completions."""

    model: NameText
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    seed: int | None = _SEED
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    user: NameText | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A content part other than text (image_url, input_audio, file, ...) is a clear 400."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, msg in enumerate(messages if isinstance(messages, list) else []):
            content = msg.get("content") if isinstance(msg, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    where = f"messages.{i}.content.{j}"
                    raise bad_request(
                        f"{where}: {kind} parts are not supported by this text-only policy", where
                    )
        return data

    def model_post_init(self, _context: Any) -> None:
        if self.logprobs or self.top_logprobs:
            raise bad_request(_NO_LOGPROBS, "logprobs" if self.logprobs else "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_param())

    def max_tokens_param(self) -> str:
        """The field `requested_max_tokens` came from, which an error about it names."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_prompt(self) -> ChatPrompt:
        """The conversation as OpenAI-style message dicts plus tool specs, validated for consistency."""
        messages: list[dict[str, Any]] = []
        for i, msg in enumerate(self.messages):
            text = _text_of(msg.content)
            role = "system" if msg.role == "developer" else msg.role
            if role in ("system", "user") and msg.content is None:
                raise bad_request(f"messages.{i}.content is required for role {msg.role!r}", f"messages.{i}")
            entry: dict[str, Any] = {"role": role, "content": text}
            if role == "assistant" and msg.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                    for call in msg.tool_calls
                ]
            if role == "tool":
                entry["tool_call_id"] = msg.tool_call_id or ""
            messages.append(entry)
        tools = [
            {"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in self.tools or []
        ]
        names = {t["function"]["name"] for t in tools}
        if len(names) != len(tools):
            raise bad_request("tools: tool names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, dict):
            wanted = (
                (choice.get("function") or {}).get("name")
                if isinstance(choice.get("function"), dict)
                else None
            )
            if choice.get("type") != "function" or not isinstance(wanted, str):
                raise bad_request(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if wanted not in names:
                raise bad_request(
                    f"tool_choice names {wanted!r}, which is not among the tools", "tool_choice"
                )
        if choice is not None and choice != "none" and not tools:
            raise bad_request("tool_choice is set but no tools are given", "tool_choice")
        return ChatPrompt(messages=messages, tools=tools, parse_tools=bool(tools) and choice != "none")


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | (Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def model_post_init(self, _context: Any) -> None:
        if self.logprobs:
            raise bad_request(_NO_LOGPROBS, "logprobs")
        if (self.best_of or 1) > 1:
            raise bad_request("best_of > 1 is not supported: one completion per call", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported (no insertion mode)", "suffix")

    def prompt_text_or_ids(self) -> str | list[int]:
        """The single prompt, as text or as token ids (a batch of one is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt


def _text_of(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def dumps_arguments(arguments: Any) -> str:
    """Tool-call arguments as the JSON string OpenAI clients expect."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
