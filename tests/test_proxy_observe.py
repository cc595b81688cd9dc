"""The proxy's call metrics: latency per API and errors by status, for /v1/ routes only, bounded labels."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from gyre_ray.proxy.observe import CallMetrics


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def request(self, api: str, seconds: float, status: int) -> None:
        assert seconds >= 0
        self.calls.append((api, status))


def test_calls_are_counted_by_api_and_status() -> None:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages() -> JSONResponse:
        return JSONResponse({"error": "invalid API key"}, status_code=401)

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    recorder = RecordingMetrics()
    app.add_middleware(CallMetrics, metrics=recorder)
    client = TestClient(app)
    assert client.post("/v1/messages").status_code == 401
    assert client.post("/v1/chat/completions").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.post("/v1/anything-else/x").status_code == 404
    assert recorder.calls == [("messages", 401), ("chat/completions", 200), ("other", 404)]
