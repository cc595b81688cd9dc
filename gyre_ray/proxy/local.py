"""The whole proxy in one process, without Ray: cells, store and app as plain objects.

For unit tests, fuzzing and quick experiments: `build_local_proxy(...)` returns a `LocalProxy` whose
`app` can be driven through `httpx.ASGITransport` (or served by uvicorn), with the same code paths
as the Serve deployment except the Ray hops.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from gyre_ray.cells.cell import EngineFactory, RolloutCell
from gyre_ray.proxy.app import build_app
from gyre_ray.proxy.clients import LocalCellClient, LocalStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.service import ProxyService
from gyre_ray.proxy.store import TrajectoryStore


@dataclass
class LocalProxy:
    app: FastAPI
    service: ProxyService
    cells: dict[str, RolloutCell]
    store: TrajectoryStore
    admin_token: str

    def register_execution(self, execution_id: str | None = None) -> dict[str, str]:
        """Register directly in the store (no HTTP); returns {"execution_id", "api_key"}."""
        return self.store.register(execution_id)


async def build_local_proxy(
    codec: ChatCodec,
    engine_factory: EngineFactory,
    records_dir: str | Path,
    num_cells: int = 2,
    section: ProxySection | None = None,
    admin_token: str | None = None,
    transfer: dict[str, Any] | None = None,
) -> LocalProxy:
    """Cells built in-process (their engines set up), an in-memory store and the FastAPI app.

    `transfer`: the cells' `transfer` section (dumped; how drained sessions' KV moves)."""
    section = section or ProxySection()
    cells = {
        f"cell-{i}": RolloutCell(f"cell-{i}", engine_factory, transfer=transfer) for i in range(num_cells)
    }
    for cell in cells.values():
        await cell.setup()
    store = TrajectoryStore(records_dir, section.store_max_records)
    token = admin_token or secrets.token_urlsafe(24)
    clients: dict[str, Any] = {cid: LocalCellClient(cell) for cid, cell in cells.items()}
    service = ProxyService(section, codec, clients, LocalStoreClient(store), token)
    return LocalProxy(build_app(service), service, cells, store, token)
