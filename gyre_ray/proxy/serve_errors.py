"""Serve's HTTP proxy, when a replica dies mid-call: a retryable 503 with Retry-After, never a bare 500.

A call inside a proxy replica that is killed fails in Serve's HTTP proxy actor with the replica's
death: before the response started, Serve answers a plain-text 500; after it started, the body just
stops. Neither tells a harness to retry. `ReplicaLossMiddleware` wraps Serve's HTTP proxy (Serve
calls `proxy_middlewares`, named by `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, when a proxy actor
starts; `gyre_ray.proxy.launch.serve_proxy` puts that variable, `PROXY_ENV`, into the Serve
controller's runtime env, which the proxy actors it starts inherit):

- no response started (the app answered nothing, raised, or Serve sent its own non-JSON 500): a
  503 in the shape of the API called (`gyre_ray.proxy.errors`) with `Retry-After`
  (`GYRE_RETRY_AFTER_S`, from `proxy.retry_after_s`). The replica had returned nothing of the call,
  so its record (if any) was never acknowledged: the harness sends the call again;
- an event stream cut before its end: a last error event in the API's shape (503, "retry the call"),
  then the end of the body, so the client reads a clean error instead of a broken stream.

Answers of the gyre app itself (JSON errors included) pass unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

from gyre_ray.proxy.errors import error_body, flavor_for_path

CALLBACK = "gyre_ray.proxy.serve_errors.proxy_middlewares"
RETRY_AFTER_ENV = "GYRE_RETRY_AFTER_S"
LOST = "the proxy replica serving this call stopped; retry the call"


def proxy_env(retry_after_s: int) -> dict[str, str]:
    """Environment variables for Serve's controller (and so its HTTP proxy actors)."""
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK, RETRY_AFTER_ENV: str(retry_after_s)}


def proxy_middlewares() -> list[Any]:
    """Serve's HTTP proxy callback: the middlewares it wraps its ASGI app in."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLossMiddleware, retry_after_s=int(os.environ.get(RETRY_AFTER_ENV, "1")))]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    return next((value for key, value in headers if key.lower() == name), b"")


class ReplicaLossMiddleware:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app: Any, retry_after_s: int = 1) -> None:
        self.app = app
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "stream": False, "swallow": False}

        async def guarded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                content_type = _header(headers, b"content-type")
                if message["status"] == 500 and b"json" not in content_type:  # Serve's own: a dead replica
                    state["swallow"] = True
                    return
                state["started"] = True
                state["stream"] = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if state["swallow"]:
                    return
                if not message.get("more_body", False):
                    state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, guarded)
        except Exception:
            if state["ended"]:
                raise
        if state["ended"]:
            return
        flavor = flavor_for_path(scope.get("path", ""))
        if not state["started"]:
            body = json.dumps(error_body(flavor, 503, LOST)).encode("utf-8")
            headers = [
                (b"content-type", b"application/json"),
                (b"retry-after", str(self.retry_after_s).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        else:  # cut mid-body: end it (with an error event in an event stream)
            tail = _stream_error(flavor).encode("utf-8") if state["stream"] else b""
            await send({"type": "http.response.body", "body": tail})


def _stream_error(flavor: str) -> str:
    payload = json.dumps(error_body(flavor, 503, LOST))  # type: ignore[arg-type]
    if flavor == "anthropic":
        return f"event: error\ndata: {payload}\n\n"
    return f"data: {payload}\n\ndata: [DONE]\n\n"
