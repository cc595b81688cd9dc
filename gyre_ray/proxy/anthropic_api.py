"""Anthropic-compatible endpoints: `/v1/messages` (streaming and not) and `/v1/messages/count_tokens`.

Streams follow Anthropic's event sequence: `message_start`, `ping`, per content block
`content_block_start` / `content_block_delta` (`text_delta` or `input_json_delta`) /
`content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`.
Tool calls parsed from the output come back as `tool_use` blocks with stop_reason "tool_use".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from gyre_ray.proxy.anthropic_schema import CountTokensRequest, MessagesRequest
from gyre_ray.proxy.errors import ApiError, error_body
from gyre_ray.proxy.front import begin, complete, one_tool_call_stop, sampling_for, sse, validate
from gyre_ray.proxy.generation import Generation, Outcome

STOP_REASON = {
    "stop": "end_turn",
    "abort": "end_turn",
    "stop_string": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_event(exc: ApiError) -> str:
    return _event("error", error_body("anthropic", exc.status, exc.message))


def _usage(outcome: Outcome) -> dict[str, int]:
    return {
        **_input_usage(outcome.prompt_tokens, outcome.cached_tokens),
        "output_tokens": outcome.completion_tokens,
    }


def _input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's split of the prompt: `input_tokens` excludes what was read from the cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


async def messages(
    service: Any, execution_id: str, body: Any, headers: dict[str, str], slot: Any
) -> Response:
    req = validate(MessagesRequest, body)
    prompt = req.to_prompt()
    one_call = one_tool_call_stop(
        service, req.parallel_tool_calls(), prompt.parse_tools, "tool_choice.disable_parallel_tool_use"
    )
    call = await service.prepare_chat(
        execution_id,
        prompt,
        "anthropic-messages",
        req.model,
        headers.get("x-gyre-role"),
        headers.get("user-agent", ""),
        session=req.session_id(),
    )
    sampling = sampling_for(
        service, call, req.temperature, req.top_p, req.max_tokens, None, extra_stop_ids=one_call
    )
    gen = await begin(
        service,
        call,
        slot,
        sampling,
        prompt.parse_tools,
        list(req.stop_sequences or []),
        "toolu_",
        req.stream,
    )
    message = {
        "id": "msg_" + call.call_id.replace("-", ""),
        "type": "message",
        "role": "assistant",
        "model": req.model,
    }
    if req.stream:
        return sse(_stream(gen, message), gen, slot, _error_event)
    outcome = await complete(gen, slot)
    content: list[dict[str, Any]] = []
    if outcome.content or not outcome.tool_calls:
        content.append({"type": "text", "text": outcome.content})
    content.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in outcome.tool_calls
    )
    return JSONResponse(
        {
            **message,
            "content": content,
            "stop_reason": STOP_REASON[outcome.finish],
            "stop_sequence": outcome.stop_string,
            "usage": _usage(outcome),
        }
    )


async def _stream(gen: Generation, message: dict[str, Any]) -> AsyncIterator[str]:
    run = gen.run  # its first tokens are in: the cache hit is known
    start_usage = {**_input_usage(len(run.call.input_ids), run.cached_tokens), "output_tokens": 0}
    yield _event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                **message,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            },
        },
    )
    yield _event("ping", {"type": "ping"})
    index = 0
    text_open = False

    def open_text() -> str:
        return _event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
        )

    def text_delta(text: str) -> str:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
        )

    async for delta in gen.text_deltas():
        if not text_open:
            yield open_text()
            text_open = True
        yield text_delta(delta)
    outcome = await gen.finish()
    tail = gen.tail_text()
    if tail or (not text_open and not outcome.tool_calls):
        if not text_open:
            yield open_text()
            text_open = True
        if tail:
            yield text_delta(tail)
    if text_open:
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    for call in outcome.tool_calls:
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        yield _event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
        )
        yield _event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments_json},
            },
        )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": STOP_REASON[outcome.finish], "stop_sequence": outcome.stop_string},
            "usage": {"output_tokens": outcome.completion_tokens},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})


async def count_tokens(
    service: Any, execution_id: str, body: Any, headers: dict[str, str], slot: Any
) -> Response:
    req = validate(CountTokensRequest, body)
    prompt = req.to_prompt()
    assistant_tokens, _ = await service.recorded_outputs(execution_id, prompt)
    try:
        ids = service.codec.prompt_ids(prompt, assistant_tokens)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    return JSONResponse({"input_tokens": len(ids)})
