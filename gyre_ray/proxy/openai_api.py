"""OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models[/{id}]`.

Responses follow OpenAI's shapes: `chat.completion` objects, or `chat.completion.chunk` SSE events
ending in `data: [DONE]`; tool calls parsed from the output come back as `tool_calls` with
finish_reason "tool_calls"; `usage` always (and as a last chunk with `stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from gyre_ray.model.chat_template import tokens_at_least
from gyre_ray.proxy.errors import ApiError, error_body
from gyre_ray.proxy.front import begin, complete, one_tool_call_stop, sampling_for, sse, validate
from gyre_ray.proxy.generation import Generation, Outcome
from gyre_ray.proxy.openai_schema import ChatCompletionRequest, CompletionRequest

FINISH = {
    "stop": "stop",
    "stop_string": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "stop",
}


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_event(exc: ApiError) -> str:
    return _data(error_body("openai", exc.status, exc.message, exc.param)) + "data: [DONE]\n\n"


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


async def chat_completions(
    service: Any, execution_id: str, body: Any, headers: dict[str, str], slot: Any
) -> Response:
    req = validate(ChatCompletionRequest, body)
    prompt = req.to_prompt()
    one_call = one_tool_call_stop(service, req.parallel_tool_calls, prompt.parse_tools, "parallel_tool_calls")
    call = await service.prepare_chat(
        execution_id,
        prompt,
        "openai-chat",
        req.model,
        headers.get("x-gyre-role"),
        headers.get("user-agent", ""),
    )
    sampling = sampling_for(
        service,
        call,
        req.temperature,
        req.top_p,
        req.requested_max_tokens(),
        req.seed,
        max_tokens_param=req.max_tokens_param(),
        extra_stop_ids=one_call,
    )
    gen = await begin(
        service, call, slot, sampling, prompt.parse_tools, req.stop_strings(), "call_", req.stream
    )
    meta = {"id": "chatcmpl-" + call.call_id, "created": int(time.time()), "model": req.model}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse(_chat_stream(gen, meta, include_usage), gen, slot, _error_event)
    outcome = await complete(gen, slot)
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content or None}
    if outcome.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in outcome.tool_calls
        ]
    elif message["content"] is None:
        message["content"] = ""
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": FINISH[outcome.finish]}
            ],
            "usage": _usage(outcome),
        }
    )


async def _chat_stream(gen: Generation, meta: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _data({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    async for delta in gen.text_deltas():
        yield chunk({"content": delta})
    outcome = await gen.finish()
    tail = gen.tail_text()
    if tail:
        yield chunk({"content": tail})
    for i, call in enumerate(outcome.tool_calls):
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                ]
            }
        )
    yield chunk({}, FINISH[outcome.finish])
    if include_usage:
        yield _data({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(outcome)})
    yield "data: [DONE]\n\n"


async def completions(
    service: Any, execution_id: str, body: Any, headers: dict[str, str], slot: Any
) -> Response:
    req = validate(CompletionRequest, body)
    prompt = req.prompt_text_or_ids()
    if isinstance(prompt, str):
        at_least = tokens_at_least(len(prompt), service.codec.longest_token_chars)  # before encoding
        service.check_prompt_length(at_least, at_least=True, param="prompt")
        ids = service.codec.encode(prompt)
    else:
        try:
            ids = service.codec.check_ids(prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt") from None
    call = service.prepare_ids(execution_id, ids, "openai-completions", req.model, headers.get("x-gyre-role"))
    sampling = sampling_for(service, call, req.temperature, req.top_p, req.max_tokens or 16, req.seed)
    gen = await begin(service, call, slot, sampling, False, req.stop_strings(), "call_", req.stream)
    meta = {"id": "cmpl-" + call.call_id, "created": int(time.time()), "model": req.model}
    echo = service.codec.decode(ids) if req.echo else ""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse(_completion_stream(gen, meta, echo, include_usage), gen, slot, _error_event)
    outcome = await complete(gen, slot)
    return JSONResponse(
        {
            **meta,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": echo + outcome.content,
                    "logprobs": None,
                    "finish_reason": FINISH[outcome.finish],
                }
            ],
            "usage": _usage(outcome),
        }
    )


async def _completion_stream(
    gen: Generation, meta: dict[str, Any], echo: str, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _data({**meta, "object": "text_completion", "choices": [choice]})

    if echo:
        yield chunk(echo)
    async for delta in gen.text_deltas():
        yield chunk(delta)
    outcome = await gen.finish()
    yield chunk("", FINISH[outcome.finish])
    if include_usage:
        yield _data({**meta, "object": "text_completion", "choices": [], "usage": _usage(outcome)})
    yield "data: [DONE]\n\n"


def model_object(service: Any) -> dict[str, Any]:
    """The served policy as a model object both SDKs parse: OpenAI's `object` / `created` /
    `owned_by` and Anthropic's `type` / `display_name` / `created_at` (RFC 3339, the same instant)."""
    name = service.codec.model_name
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "gyre-ray",
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }


def models(service: Any) -> Response:
    """`GET /v1/models`: one page holding the served policy (OpenAI's list and Anthropic's page)."""
    model = model_object(service)
    return JSONResponse(
        {
            "object": "list",
            "data": [model],
            "has_more": False,
            "first_id": model["id"],
            "last_id": model["id"],
        }
    )


def model(service: Any, model_id: str) -> Response:
    """`GET /v1/models/{id}`: any model name in a request maps to the served policy, so every id
    retrieves it (the object names the policy that serves it)."""
    del model_id
    return JSONResponse(model_object(service))
