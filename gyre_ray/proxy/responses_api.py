"""OpenAI Responses API: `POST /v1/responses`, streaming and not (what `codex exec` speaks).

The output is a list of items: a `message` with one `output_text` part when the policy wrote text,
then one `function_call` item per tool call parsed from its output. Streams are `event:` / `data:`
SSE events with a `sequence_number`: `response.created`, `response.in_progress`, per item
`response.output_item.added`, (`response.content_part.added`, `response.output_text.delta`,
`response.output_text.done`, `response.content_part.done`) or
(`response.function_call_arguments.delta` / `.done`), `response.output_item.done`, and finally
`response.completed` (or `response.incomplete` when max_output_tokens ended it, its message item
then "incomplete" too), whose response carries `usage`; the response echoes the request's
`instructions` and `tools`. `parallel_tool_calls: false` stops generation once the first call is
closed (`front.one_tool_call_stop`). Sessions come from Codex's `session-id` / `thread-id` headers; its
`x-codex-turn-metadata` feeds the role rules (`gyre_ray.proxy.roles.codex_role`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from gyre_ray.proxy.errors import ApiError
from gyre_ray.proxy.front import begin, complete, one_tool_call_stop, sampling_for, sse, validate
from gyre_ray.proxy.generation import Generation, Outcome, ToolCallOut
from gyre_ray.proxy.openai_schema import session_or_none
from gyre_ray.proxy.responses_schema import ResponsesRequest
from gyre_ray.proxy.roles import codex_role


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _call_item(
    item_id: str, call: ToolCallOut, arguments: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    args = call.arguments_json if arguments is None else arguments
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": args,
        "status": status,
    }


class _Shell:
    """The response object around the output, in one state or another."""

    def __init__(self, response_id: str, req: ResponsesRequest) -> None:
        self.base = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": req.model,
            "instructions": req.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, (str, dict)) else "auto",
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "error": None,
        }

    def state(
        self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None
    ) -> dict[str, Any]:
        body = {**self.base, "status": status, "output": output, "incomplete_details": None, "usage": None}
        if outcome is not None:
            body["usage"] = _usage(outcome)
            if outcome.finish == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body


def _status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish == "length" else "completed"


def session_of(headers: dict[str, str]) -> str | None:
    """The conversation a call belongs to: Codex's `session-id` (or `thread-id`), else none."""
    return session_or_none(headers.get("session-id") or headers.get("thread-id"))


async def responses(
    service: Any, execution_id: str, body: Any, headers: dict[str, str], slot: Any
) -> Response:
    req = validate(ResponsesRequest, body)
    prompt = req.to_prompt()
    one_call = one_tool_call_stop(service, req.parallel_tool_calls, prompt.parse_tools, "parallel_tool_calls")
    role_header = headers.get("x-gyre-role") or codex_role(headers)
    call = await service.prepare_chat(
        execution_id, prompt, "openai-responses", req.model, role_header,
        headers.get("user-agent", ""), session=session_of(headers),
    )  # fmt: skip
    sampling = sampling_for(
        service, call, req.temperature, req.top_p, req.max_output_tokens, None, "max_output_tokens", one_call
    )
    gen = await begin(service, call, slot, sampling, prompt.parse_tools, [], "call_", req.stream)
    shell = _Shell("resp_" + call.call_id.replace("-", ""), req)
    if req.stream:
        events = _Events()
        return sse(_stream(gen, shell, events), gen, slot, events.error)
    outcome = await complete(gen, slot)
    output: list[dict[str, Any]] = []
    status = _status(outcome)
    if outcome.content or not outcome.tool_calls:
        output.append(_message_item(_item_id("msg"), outcome.content, status))
    output.extend(_call_item(_item_id("fc"), c) for c in outcome.tool_calls)
    return JSONResponse(shell.state(status, output, outcome))


class _Events:
    """Numbered SSE events of one stream (an error event takes the next number too)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error(self, exc: ApiError) -> str:
        """The stream's `error` event for `exc`."""
        code = "server_error" if exc.status >= 500 else "invalid_request_error"
        return self("error", code=code, message=exc.message, param=exc.param)


async def _stream(gen: Generation, shell: _Shell, event: _Events) -> AsyncIterator[str]:
    yield event("response.created", response=shell.state("in_progress", []))
    yield event("response.in_progress", response=shell.state("in_progress", []))
    output: list[dict[str, Any]] = []
    msg_id, text, opened = _item_id("msg"), "", False

    def open_message() -> list[str]:
        part = {"type": "output_text", "text": "", "annotations": []}
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part),
        ]

    def delta(piece: str) -> str:
        return event(
            "response.output_text.delta",
            item_id=msg_id,
            output_index=0,
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    async for piece in gen.text_deltas():
        if not opened:
            for line in open_message():
                yield line
            opened = True
        text += piece
        yield delta(piece)
    outcome = await gen.finish()
    tail = gen.tail_text()
    if tail or (not opened and not outcome.tool_calls):
        if not opened:
            for line in open_message():
                yield line
            opened = True
        if tail:
            text += tail
            yield delta(tail)
    status = _status(outcome)
    if opened:
        item = _message_item(msg_id, text, status)
        yield event(
            "response.output_text.done",
            item_id=msg_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        )
        yield event(
            "response.content_part.done",
            item_id=msg_id,
            output_index=0,
            content_index=0,
            part=item["content"][0],
        )
        yield event("response.output_item.done", output_index=0, item=item)
        output.append(item)
    for call in outcome.tool_calls:
        index, fc_id = len(output), _item_id("fc")
        yield event(
            "response.output_item.added", output_index=index, item=_call_item(fc_id, call, "", "in_progress")
        )
        args = call.arguments_json
        yield event("response.function_call_arguments.delta", item_id=fc_id, output_index=index, delta=args)
        yield event(
            "response.function_call_arguments.done", item_id=fc_id, output_index=index, arguments=args
        )
        item = _call_item(fc_id, call)
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event(kind, response=shell.state(status, output, outcome))
