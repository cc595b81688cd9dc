"""OpenAI Responses API request bodies (`POST /v1/responses`) and their translation to a prompt.

`input` is a string (one user message) or a list of items: messages (`role` user / system /
developer / assistant, content a string or `input_text` / `output_text` parts), `function_call`
items (an earlier output's tool calls) and `function_call_output` items (their results).
Content parts other than text (`input_image`, `input_file`, `input_audio`, ...), in messages or in
a `function_call_output`'s output, are a 400: the policy reads text only.
`instructions` becomes the first system message. An assistant message and the function calls that
follow it form one assistant turn, as the policy produced them, so the recorded output is spliced
back token-exact. `reasoning` items, non-function tools (Codex's `web_search`, `custom`, ...) and
fields the policy cannot honour (`reasoning`, `include`, `store`, `text`, `prompt_cache_key`) are
accepted and ignored; `previous_response_id` is refused (the proxy keeps no response state: send
the whole input, as Codex does).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator

from gyre_ray.proxy.errors import bad_request
from gyre_ray.proxy.openai_schema import Lenient, NameText, dumps_arguments
from gyre_ray.proxy.prompt import ChatPrompt, check_parameters_schema, check_tool_name

ROLE_MAP = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "refusal")


class ContentPart(Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _check_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_parameters_schema(value)


class ResponsesRequest(Lenient):
    model: NameText
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None

    def function_tools(self) -> list[dict[str, Any]]:
        """The `function` tools as chat-template tool specs (other tool types are ignored)."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                continue
            if not tool.name:
                raise bad_request(f"tools.{i}.name is required for a function tool", f"tools.{i}.name")
            try:
                check_tool_name(tool.name)
            except ValueError as exc:
                raise bad_request(str(exc), f"tools.{i}.name") from None
            spec = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
            if tool.description:
                spec["description"] = tool.description
            tools.append({"type": "function", "function": spec})
        if len({t["function"]["name"] for t in tools}) != len(tools):
            raise bad_request("tools: tool names must be unique", "tools")
        return tools

    def to_prompt(self) -> ChatPrompt:
        if self.previous_response_id:
            raise bad_request(
                "previous_response_id is not supported: the proxy keeps no response state; "
                "send the whole conversation in input",
                "previous_response_id",
            )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            _add_item(messages, item, f"input.{i}")
        if not any(m["role"] != "system" for m in messages):
            raise bad_request("input holds no user, assistant or tool turn", "input")
        tools = self.function_tools()
        choice = self.tool_choice
        parse = bool(tools) and choice != "none"
        names = {t["function"]["name"] for t in tools}
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or an object', "tool_choice")
        if choice == "required" and not names:
            raise bad_request('tool_choice "required" needs function tools to choose from', "tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = choice.get("name")
            if not isinstance(name, str) or name not in names:
                raise bad_request(f"tool_choice names {name!r}, not among the tools", "tool_choice")
        return ChatPrompt(messages=messages, tools=tools, parse_tools=parse)


def _text(content: Any, where: str, field: str = "content") -> str:
    """The text of `content` (a string or text parts); `where.field` names it in errors."""
    at = f"{where}.{field}"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of content parts", at)
    texts = []
    for j, raw in enumerate(content):
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            raise bad_request(f"{at}.{j} must be a content part with a type", f"{at}.{j}")
        kind = raw["type"]
        if kind not in TEXT_PARTS:  # input_image, input_file, input_audio, ...: never silently dropped
            raise bad_request(
                f"{at}.{j}: {kind} parts are not supported by this text-only policy", f"{at}.{j}"
            )
        try:
            part = ContentPart.model_validate(raw)
        except ValidationError as exc:
            problem = exc.errors()[0]
            field_at = ".".join(str(x) for x in problem["loc"])
            raise bad_request(f"{at}.{j}.{field_at}: {problem['msg']}", f"{at}.{j}") from None
        texts.append(part.text if part.text is not None else part.refusal or "")
    return "\n".join(texts)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = ROLE_MAP.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise bad_request(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        for key in ("call_id", "name"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise bad_request(f"{where}.{key} is required for a function_call item", f"{where}.{key}")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": dumps_arguments(item.get("arguments", "{}"))},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # this turn's text, then its calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_request(
                f"{where}.call_id is required for a function_call_output item", f"{where}.call_id"
            )
        output = item.get("output", "")
        text = output if isinstance(output, str) else _text(output, where, "output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    elif kind == "reasoning" or kind == "item_reference":
        return  # the policy has no hidden reasoning to resume; references need stored state
    elif isinstance(kind, str):
        raise bad_request(f"{where}: input items of type {kind!r} are not supported", f"{where}.type")
    else:
        raise bad_request(f"{where} needs a type (message, function_call, function_call_output)", where)
