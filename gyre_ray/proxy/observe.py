"""ASGI middleware: every model call's latency (to its response headers) and error status, as Ray metrics.

Pure ASGI (no per-request task or body buffering), so streams pass through untouched. The API label
is the route after `/v1/` (`chat/completions`, `messages`, `responses`, ...; any other path is
`other`, so a client cannot grow the label set); only `/v1/` routes count.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from gyre_ray.observability.ray_metrics import ProxyMetrics

Scope = dict[str, Any]
Message = dict[str, Any]
APIS = frozenset(
    {"chat/completions", "completions", "responses", "messages", "messages/count_tokens", "models"}
)
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


class CallMetrics:
    """Wraps an ASGI app; records `/v1/...` calls into `ProxyMetrics`."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics or ProxyMetrics()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        api = path[len("/v1/") :].rstrip("/")
        api = api if api in APIS else "other"

        async def observed(message: Message) -> None:
            if message.get("type") == "http.response.start":
                self.metrics.request(api, time.perf_counter() - started, int(message.get("status", 0)))
            await send(message)

        await self.app(scope, receive, observed)
