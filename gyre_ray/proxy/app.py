"""The proxy's HTTP surface: a FastAPI app over a `ProxyService` (model APIs, admin API, errors).

Model APIs (an execution's API key as `Authorization: Bearer` or `x-api-key`):
  POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
  POST /v1/messages, POST /v1/messages/count_tokens (query strings such as ?beta=true are ignored),
  POST /v1/responses (the Responses API).
Admin API (the admin token, same headers):
  POST /gyre/executions -> {"execution_id", "api_key"};  POST /gyre/executions/{id}/finish;
  GET /gyre/executions/{id}/records (JSONL; an execution's own key may read its own records);
  GET /gyre/cells;  POST /gyre/cells/{id}/drain | /undrain;  GET /gyre/stats.
Unauthenticated: HEAD|GET / and GET /gyre/health.
Every error is a 4xx/5xx JSON body in the shape of the API the path belongs to; no traceback leaves.
A 429 or 503 (no slot, no routable cell, a cell that died) is retryable and carries `Retry-After`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from gyre_ray.json_values import finite_float, reject_constant
from gyre_ray.proxy import anthropic_api, openai_api, responses_api
from gyre_ray.proxy.clients import CellUnavailable
from gyre_ray.proxy.errors import ApiError, error_body, flavor_for_path
from gyre_ray.proxy.observe import CallMetrics

log = logging.getLogger(__name__)
Handler = Callable[[Any, str, Any, dict[str, str], Any], Awaitable[Response]]


RETRYABLE = (429, 503)


def _error_response(
    request: Request, status: int, message: str, param: str | None = None, retry_after_s: int = 1
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if status in RETRYABLE else None
    return JSONResponse(
        error_body(flavor_for_path(request.url.path), status, message, param),
        status_code=status,
        headers=headers,
    )


def _credentials(request: Request) -> list[str]:
    """Keys offered by the client: `x-api-key` and/or `Authorization: Bearer ...`."""
    found = []
    key = request.headers.get("x-api-key")
    if key:
        found.append(key.strip())
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        found.append(auth[7:].strip())
    return [k for k in found if k]


async def _read_body(request: Request, limit: int, idle_s: float) -> bytes:
    """The whole body: 413 above `limit` bytes; 503 (retryable) when no piece arrives for `idle_s`.

    The idle bound is how a call whose body went missing on the way ends instead of hanging: behind
    Serve's HTTP proxy, a replica killed after it fetched the body but before the router heard it
    accepted the call makes the router send the call to another replica, which would wait for a
    body that no longer comes (so would a client that stops sending mid-body).
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit} bytes")
    body = bytearray()
    pieces = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), idle_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise ApiError(
                503, f"the request body stopped arriving (nothing for {idle_s:g} s); send the call again"
            ) from None
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    return bytes(body)


async def _read_json(request: Request, limit: int, idle_s: float) -> Any:
    return _parse_json(await _read_body(request, limit, idle_s))


MAX_JSON_DEPTH = 100  # arrays and objects within one another; a tool schema needs a handful


def _parse_json(body: bytes) -> Any:
    """The parsed body: 400 for an empty, malformed or non-text (not UTF-8, a lone surrogate) one, a
    number out of float range (it could not be echoed back as JSON), or one nested deeper than
    `MAX_JSON_DEPTH` (later steps recurse into it)."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"the request body is not UTF-8 text (byte {exc.start} cannot be decoded)"
        ) from None
    try:
        value = json.loads(text, parse_constant=reject_constant, parse_float=finite_float)
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    except ValueError as exc:
        if "digits" in str(exc):  # Python's int-size guard; its message talks about sys
            raise ApiError(400, "malformed JSON: a number has more than 4300 digits") from None
        raise ApiError(400, f"malformed JSON: {exc}") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # (fewer cannot nest that deep)
        _reject_deep_nesting(value)
    if _SURROGATE_ESCAPE.search(text):  # only an escape can put a surrogate in the decoded text
        _reject_lone_surrogates(value)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_deep_nesting(value: Any) -> None:
    """400 for arrays and objects nested deeper than `MAX_JSON_DEPTH`."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    raise ApiError(400, f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels")
                stack.append((child, depth + 1))


def _reject_lone_surrogates(value: Any) -> None:
    """400 for a string holding an unpaired \\ud800-\\udfff escape: valid JSON, but not text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400,
                    "malformed JSON: a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)",
                ) from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def build_app(service: Any) -> FastAPI:
    """The FastAPI app serving `service` (a ProxyService)."""
    app = FastAPI(title="gyre-ray proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(CallMetrics)  # latency and errors of model calls, for the Ray dashboard
    limit = service.section.max_request_bytes
    body_idle_s = service.section.body_timeout_s

    retry_after_s = service.section.retry_after_s

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc.status, exc.message, exc.param, retry_after_s)

    @app.exception_handler(CellUnavailable)
    async def _cell_unavailable(request: Request, exc: CellUnavailable) -> JSONResponse:
        return _error_response(request, 503, f"{exc}; retry shortly", None, retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route for {request.method} {request.url.path}"
        return _error_response(request, exc.status_code, detail, None, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, 400, f"invalid request: {exc.errors()[:3]}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("proxy error on %s %s", request.method, request.url.path)
        return _error_response(request, 500, "internal proxy error; the call was not completed")

    async def execution_of(request: Request) -> str:
        keys = _credentials(request)
        if not keys:
            raise ApiError(401, "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'")
        for key in keys:
            execution_id = await service.execution_for_key(key)
            if execution_id is not None:
                return execution_id
        for key in keys:
            finished = await service.finished_execution_for_key(key)
            if finished is not None:
                raise ApiError(401, f"invalid API key: execution {finished!r} has ended (its key is revoked)")
        raise ApiError(401, "invalid API key: it names no registered execution")

    def require_admin(request: Request) -> None:
        keys = _credentials(request)
        if not keys:
            raise ApiError(401, "the admin API needs the admin token ('Authorization: Bearer <token>')")
        if not any(service.is_admin(k) for k in keys):
            raise ApiError(401, "invalid admin token")

    async def model_call(request: Request, handler: Handler) -> Response:
        execution_id = await execution_of(request)
        # The slot comes before the body: an execution holds at most its limit of bodies in memory,
        # however many calls it opens (the rest wait unread, then 429).
        slot = await service.acquire_slot(execution_id)
        try:
            body = await _read_json(request, limit, body_idle_s)
            headers = {k.lower(): v for k, v in request.headers.items()}
            return await handler(service, execution_id, body, headers, slot)
        finally:
            if not slot.bound:  # a stream releases its slot as it ends
                slot.release()

    # ---- unauthenticated -------------------------------------------------------------------
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return JSONResponse({"status": "ok", "service": "gyre-ray proxy"})

    @app.get("/gyre/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok", "cells": len(service.cells)})

    # ---- model APIs --------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await model_call(request, openai_api.chat_completions)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await model_call(request, openai_api.completions)

    async def caller_execution(request: Request) -> str | None:
        """None for the admin token, else the execution the caller's key names (401 for neither)."""
        if any(service.is_admin(k) for k in _credentials(request)):
            return None
        return await execution_of(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        await caller_execution(request)
        return openai_api.models(service)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        await caller_execution(request)
        return openai_api.model(service, model_id)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await model_call(request, responses_api.responses)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await model_call(request, anthropic_api.messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await model_call(request, anthropic_api.count_tokens)

    # ---- admin API ---------------------------------------------------------------------------
    @app.post("/gyre/executions")
    async def register(request: Request) -> Response:
        require_admin(request)
        raw = await _read_body(request, limit, body_idle_s)
        body: Any = _parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object (optional keys: execution_id, metadata)")
        execution_id, metadata = body.get("execution_id"), body.get("metadata")
        if execution_id is not None and not isinstance(execution_id, str):
            raise ApiError(400, "execution_id must be a string", "execution_id")
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object", "metadata")
        created = await service.register_execution(execution_id, metadata)
        return JSONResponse(created, status_code=201)

    async def require_admin_or_own(request: Request, execution_id: str) -> str | None:
        """The caller's execution (None: the admin); 403 for another execution's key."""
        own = await caller_execution(request)
        if own is not None and own != execution_id:
            raise ApiError(403, "an execution's key may read or close only its own execution")
        return own

    @app.get("/gyre/executions/{execution_id}")
    async def execution(request: Request, execution_id: str) -> Response:
        await require_admin_or_own(request, execution_id)
        return JSONResponse(await service.execution_summary(execution_id))

    @app.get("/gyre/executions/{execution_id}/records")
    async def records(request: Request, execution_id: str) -> Response:
        if await require_admin_or_own(request, execution_id) is None:  # the admin: unbounded
            return PlainTextResponse(
                await service.records_jsonl(execution_id), media_type="application/x-ndjson"
            )
        # an execution's own read takes one of its call slots: code it left cannot open any number of
        # whole-trajectory reads at once (each a full copy in the store actor and here)
        slot = await service.acquire_slot(execution_id)
        try:
            text = await service.records_jsonl(execution_id)
        finally:
            slot.release()
        return PlainTextResponse(text, media_type="application/x-ndjson")

    @app.post("/gyre/executions/{execution_id}/close")
    async def close(request: Request, execution_id: str) -> Response:
        """The execution's own key (or the admin token) revokes that key: its harness has ended."""
        await require_admin_or_own(request, execution_id)
        return JSONResponse(await service.close_execution(execution_id))

    @app.post("/gyre/executions/{execution_id}/finish")
    async def finish(request: Request, execution_id: str) -> Response:
        require_admin(request)
        path = await service.finish_execution(execution_id)
        return JSONResponse({"execution_id": execution_id, "records_path": path})

    @app.get("/gyre/cells")
    async def cells(request: Request) -> Response:
        require_admin(request)
        return JSONResponse({"cells": await service.cell_status()})

    @app.post("/gyre/cells/{cell_id}/drain")
    async def drain(request: Request, cell_id: str) -> Response:
        require_admin(request)
        moved = await service.drain(cell_id)
        return JSONResponse({"cell_id": cell_id, "draining": True, "migrated": moved})

    @app.post("/gyre/cells/{cell_id}/undrain")
    async def undrain(request: Request, cell_id: str) -> Response:
        require_admin(request)
        await service.undrain(cell_id)
        return JSONResponse({"cell_id": cell_id, "draining": False})

    @app.get("/gyre/stats")
    async def stats(request: Request) -> Response:
        require_admin(request)
        store_stats = await service.store_read("stats")
        return JSONResponse({"proxy": dict(service.counters), "store": store_stats})

    return app
