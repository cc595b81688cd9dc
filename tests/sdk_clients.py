"""The openai and anthropic SDK clients (and a raw httpx client) on an in-process proxy app, per execution."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai

# A tool both API test modules offer the scripted model (OpenAI shape).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Clients:
    """openai / anthropic SDK clients and a raw httpx client (sending the key with `http_sends_key`),
    all on the app."""

    def __init__(self, proxy: Any, api_key: str, http_sends_key: bool = False) -> None:
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=proxy.app),
            base_url="http://proxy",
            headers={"Authorization": "Bearer " + api_key} if http_sends_key else None,
        )
        self.http2 = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=proxy.app), base_url="http://proxy"
        )
        self.openai = openai.AsyncOpenAI(
            api_key=api_key, base_url="http://proxy/v1", http_client=self.http, max_retries=0
        )
        self.anthropic = anthropic.AsyncAnthropic(
            api_key=api_key, base_url="http://proxy", http_client=self.http2, max_retries=0
        )

    async def close(self) -> None:
        await self.http.aclose()
        await self.http2.aclose()


def scenario(
    proxy: Any, body: Callable[[Clients, str], Awaitable[Any]], http_sends_key: bool = False
) -> tuple[Any, list]:
    """Run `body(clients, execution_id)` against a fresh execution; return (result, its records)."""
    created = proxy.register_execution()

    async def main() -> Any:
        clients = Clients(proxy, created["api_key"], http_sends_key)
        try:
            return await body(clients, created["execution_id"])
        finally:
            await clients.close()

    result = asyncio.run(main())
    return result, proxy.store.records(created["execution_id"])
