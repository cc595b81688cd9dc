"""Test helper: a LocalProxy under uvicorn in a background thread, keeping the model-API bodies and
headers it received (to compare what a real harness sent with what was recorded)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from gyre_ray.model.config import ModelSection
from gyre_ray.ports import free_port
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.local import build_local_proxy

CODEC = ChatCodec.for_model(ModelSection())
KEPT_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


class ServedProxy:
    """`bodies` / `headers`: per model call received, in order (`paths` says which API)."""

    def __init__(self, factory, tmp_path: Path, section: ProxySection, num_cells: int = 1) -> None:
        import uvicorn

        self.proxy = asyncio.run(build_local_proxy(CODEC, factory, tmp_path / "records", num_cells, section))
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.paths: list[str] = []

        @self.proxy.app.middleware("http")
        async def keep_bodies(request, call_next):
            if request.url.path in KEPT_PATHS:
                self.paths.append(request.url.path)
                self.bodies.append(json.loads(await request.body()))
                self.headers.append({k.lower(): v for k, v in request.headers.items()})
            return await call_next(request)

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.proxy.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        for cell in self.proxy.cells.values():
            cell.close()
