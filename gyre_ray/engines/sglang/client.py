"""An async client for SGLang's native HTTP API, speaking token ids (no text anywhere).

One method per route the engine uses: `/generate` (streamed as server-sent events, or in one
reply), `/abort_request`, `/flush_cache`, `/release_memory_occupation` and
`/resume_memory_occupation`, `/update_weights_from_disk`, `/update_weights_from_tensor`,
`/init_weights_update_group` and `/update_weights_from_distributed`, `/health_generate` and
`/get_server_info`. With `api_key` (the server's `--api-key`) every request carries
`Authorization: Bearer KEY`; a server that refuses it answers 401, an `SGLangServerError` that
says so. Every failure is an `SGLangServerError` naming the cell and the server URL (a refused
generate request is an `EngineInputError`), and every call is bounded by the connect and request
timeouts, so a dead server fails a call instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gyre_ray.engines.base import EngineInputError


class SGLangServerError(RuntimeError):
    """The SGLang server is unreachable, timed out, or refused a control call."""


class SGLangClient:
    """HTTP calls to one SGLang server. Safe to use from several event loops (one connection pool each)."""

    def __init__(
        self,
        url: str,
        cell_id: str = "engine",
        connect_timeout_s: float = 10.0,
        request_timeout_s: float = 3600.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.cell_id = cell_id
        self.timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    # ---- plumbing -------------------------------------------------------------------------------
    def _where(self, route: str) -> str:
        return f"cell {self.cell_id}: SGLang server {self.url}{route}"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                self._clients.pop(old)
            client = self._clients[loop] = httpx.AsyncClient(
                base_url=self.url, timeout=self.timeout, headers=self._headers
            )
        return client

    def _failure(self, route: str, exc: Exception) -> SGLangServerError:
        if isinstance(exc, httpx.TimeoutException):
            why = f"timed out ({type(exc).__name__})"
        elif isinstance(exc, httpx.ConnectError):
            why = "is not reachable (connection refused or host down)"
        else:
            why = f"failed: {type(exc).__name__}: {exc}"
        return SGLangServerError(f"{self._where(route)} {why}")

    async def post(self, route: str, body: dict[str, Any] | None = None, ok_400: bool = False) -> Any:
        """POST `body` as JSON; the decoded JSON reply (or its text). Non-2xx raises SGLangServerError."""
        try:
            response = await self._client().post(route, json=body or {})
        except httpx.HTTPError as exc:
            raise self._failure(route, exc) from None
        return self._decode(route, response, ok_400)

    async def get(self, route: str) -> Any:
        try:
            response = await self._client().get(route)
        except httpx.HTTPError as exc:
            raise self._failure(route, exc) from None
        return self._decode(route, response)

    def _decode(self, route: str, response: httpx.Response, ok_400: bool = False) -> Any:
        try:
            payload: Any = response.json()
        except ValueError:
            payload = response.text
        if response.status_code >= 400 and not (ok_400 and response.status_code == 400):
            raise SGLangServerError(self._refusal(route, response.status_code, payload))
        if isinstance(payload, dict) and payload.get("success") is False:
            raise SGLangServerError(f"{self._where(route)} refused: {payload.get('message', payload)}")
        return payload

    def _refusal(self, route: str, status: int, payload: Any) -> str:
        said = f"{self._where(route)} answered HTTP {status}: {_message(payload)}"
        if status in (401, 403):
            given = "the engine's API key" if self._headers else "no API key"
            said += (
                f" (it refused {given}; a server at engine.sglang.url takes its key from "
                "engine.sglang.api_key_env)"
            )
        return said

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for loop, client in clients.items():
            if loop is asyncio.get_running_loop():
                await client.aclose()

    # ---- generation -----------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """One non-streamed /generate: the server's reply (`output_ids`, `meta_info`)."""
        try:
            response = await self._client().post("/generate", json={**body, "stream": False})
        except httpx.HTTPError as exc:
            raise self._failure("/generate", exc) from None
        if response.status_code == 400:
            raise EngineInputError(f"{self._where('/generate')} refused the request: {_message(response)}")
        return self._decode("/generate", response)

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A streamed /generate: yields each `data:` chunk (a dict) until `[DONE]`."""
        try:
            async with self._client().stream("POST", "/generate", json={**body, "stream": True}) as response:
                if response.status_code >= 400:
                    await response.aread()
                    kind = EngineInputError if response.status_code == 400 else SGLangServerError
                    raise kind(self._refusal("/generate", response.status_code, response))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise EngineInputError(
                            f"{self._where('/generate')} refused the request: {_message(chunk)}"
                        )
                    yield chunk
        except httpx.HTTPError as exc:
            raise self._failure("/generate", exc) from None
        raise SGLangServerError(f"{self._where('/generate')} closed the stream before [DONE]")

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (`rid`) or, with None, every request."""
        await self.post("/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})

    # ---- memory, cache, weights -----------------------------------------------------------------
    async def flush_cache(self) -> bool:
        """Flush the radix cache; False when the server refused (it had requests running)."""
        try:
            response = await self._client().post("/flush_cache")
        except httpx.HTTPError as exc:
            raise self._failure("/flush_cache", exc) from None
        if response.status_code not in (200, 400):
            self._decode("/flush_cache", response)
        return response.status_code == 200

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.post("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.post("/resume_memory_occupation", {"tags": tags})

    async def update_weights_from_disk(self, model_path: str, version: int, flush_cache: bool = True) -> None:
        await self.post(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(version), "flush_cache": flush_cache},
        )

    async def update_weights_from_tensor(self, serialized: list[str], version: int) -> None:
        """`serialized`: one string per tensor-parallel rank (SGLang's serializer output)."""
        await self.post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": serialized, "weight_version": str(version), "flush_cache": True},
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        await self.post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int
    ) -> None:
        await self.post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )

    # ---- health ---------------------------------------------------------------------------------
    async def healthy(self) -> bool:
        """True when /health_generate answers 200 (the server can generate one token)."""
        try:
            response = await self._client().get("/health_generate")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def server_info(self) -> dict[str, Any]:
        info = await self.get("/get_server_info")
        return info if isinstance(info, dict) else {"raw": info}


def _message(payload: Any) -> str:
    """The human part of an error reply (SGLang sends {"message"} or {"error": {"message"}})."""
    if isinstance(payload, httpx.Response):
        try:
            payload = payload.json()
        except ValueError:
            payload = payload.text
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(inner)
    return str(payload)[:500]
