"""Plumbing shared by the OpenAI and Anthropic front ends: body validation, sampling, streaming.

`begin` starts a call in the execution slot the app took for it (before reading its body) and
waits for its first tokens; `complete` runs a non-streaming call to the end; `sse` wraps a front
end's event generator so that the slot is released, a client that goes away aborts the engine
request (and the partial call is still recorded), and a failure mid-stream becomes an error event
instead of a broken connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import StreamingResponse

from gyre_ray.engines.base import SamplingParams
from gyre_ray.model.chat_template import TOOL_CALL_CLOSE
from gyre_ray.proxy.calls import PreparedCall
from gyre_ray.proxy.errors import ApiError
from gyre_ray.proxy.generation import Generation, Outcome
from gyre_ray.proxy.prompt import format_validation_error

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (what the client sent, not Python's name for it)."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    return names.get(type(value), "an array" if isinstance(value, list) else "an object")


def validate(model: type[M], body: Any) -> M:
    """The body as `model`, or a 400 naming the offending fields."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise ApiError(400, message, param) from None


def sampling_for(
    service: Any,
    call: PreparedCall,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    seed: int | None,
    max_tokens_param: str = "max_tokens",
    extra_stop_ids: list[int] | None = None,
) -> SamplingParams:
    """Engine sampling params; max_tokens is capped to the context left after the prompt.

    When the proxy's own `max_output_tokens` is what limits the call, the call is marked
    `proxy_capped`: hitting that limit ends the turn normally for the client (the limit is the
    trainer's, not the client's), while the record keeps finish_reason "length".
    """
    max_new = service.max_new_tokens(len(call.input_ids), max_tokens, max_tokens_param)
    cap = service.section.max_output_tokens
    if cap is not None and max_new == cap and (max_tokens is None or max_tokens > cap):
        call.meta["proxy_capped"] = True
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        max_new_tokens=max_new,
        stop_token_ids=sorted(service.codec.stop_ids) + list(extra_stop_ids or []),
        seed=None if seed is None else seed % (1 << 63),
    )


def one_tool_call_stop(
    service: Any, parallel_tool_calls: bool | None, parse_tools: bool, param: str
) -> list[int]:
    """Stop ids that end generation right after the first tool call (`parallel_tool_calls: false`).

    The engine stops on the token that closes the first call, so the output holds at most one call
    and the record is exactly what the client gets (nothing is dropped after sampling). A tokenizer
    without a single token for the closing tag cannot be constrained that way: a 400 naming `param`.
    """
    if parallel_tool_calls is not False or not parse_tools:
        return []
    tokenizer = service.codec.tokenizer
    close = tokenizer.encode(TOOL_CALL_CLOSE)
    if len(close) != 1 or close[0] not in tokenizer.backend.get_added_tokens_decoder():
        raise ApiError(
            400,
            f"{param} is not supported: this policy's tokenizer has no added token for "
            f"{TOOL_CALL_CLOSE!r} to stop on after one tool call",
            param,
        )
    return close


async def begin(
    service: Any,
    call: PreparedCall,
    slot: Any,
    sampling: SamplingParams,
    parse_tools: bool,
    stop_strings: list[str],
    tool_id_prefix: str,
    stream: bool = True,
) -> Generation:
    """Start the call, in the execution slot it holds, and wait for its first tokens.

    A call that fails before the engine produced anything (refused, no cell) is not recorded.
    """
    run = service.start(call, sampling, stream=stream or bool(stop_strings))  # stop strings need early tokens
    gen = Generation(service, run, parse_tools, stop_strings, tool_id_prefix)
    try:
        await gen.start()
    except BaseException as exc:
        slot.release()
        if run.output_ids:
            reason = "failed" if isinstance(exc, ApiError) else "client_disconnected"
            await asyncio.shield(gen.abandon(reason))
        else:
            await asyncio.shield(run.cancel())
        raise
    return gen


async def complete(gen: Generation, slot: Any) -> Outcome:
    """Run a started call to the end (non-streaming)."""
    try:
        await gen.collect()
        return await gen.finish()
    except ApiError:
        await asyncio.shield(gen.abandon("failed"))
        raise
    except BaseException:
        await asyncio.shield(gen.abandon())
        raise
    finally:
        slot.release()


def sse(
    events: AsyncIterator[str],
    gen: Generation,
    slot: Any,
    error_event: Callable[[ApiError], str],
) -> StreamingResponse:
    """A text/event-stream response over `events` (already SSE-formatted strings)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except ApiError as exc:
            await asyncio.shield(gen.abandon("failed"))
            yield error_event(exc)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            log.exception("proxy stream failed")
            yield error_event(ApiError(500, "internal error while streaming; the call was aborted"))
        finally:  # (here, once the events' stream is closed, the call is settled at once; the
            # response's own settling, `_RecordedStream`, covers a body that never ran)
            slot.release()
            if gen.outcome is None:
                await asyncio.shield(gen.abandon())

    stream = body()
    slot.bind(stream)
    return _RecordedStream(stream, gen, slot)


class _RecordedStream(StreamingResponse):
    """An SSE response that settles its call however the response ends. The server may cancel the
    response before its body generator ever runs (the client went away while the first tokens were
    awaited): the generator's own `finally` never runs then, so here the slot is released and the
    call abandoned (stopped, its tokens so far recorded as `client_disconnected`)."""

    def __init__(self, stream: AsyncIterator[str], gen: Generation, slot: Any) -> None:
        super().__init__(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        self._gen, self._slot = gen, slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
            if self._gen.outcome is None:
                await asyncio.shield(self._gen.abandon())
