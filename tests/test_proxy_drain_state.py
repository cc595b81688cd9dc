"""A cell's own drain flag is the one truth for routing across proxy replicas.

Two `ProxyService` replicas over the same in-process cells: a drain or undrain made through one
replica (or on the cell itself, as the scheduler does) reaches the other through its drain watch, and a
replica that was refused by a draining cell routes to it again once the cell is undrained.
"""

from __future__ import annotations

import asyncio

from gyre_ray.cells.cell import RolloutCell
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.clients import LocalCellClient, LocalStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.service import ProxyService
from gyre_ray.proxy.store import TrajectoryStore

SECTION = ProxySection(drain_poll_s=0.01)


async def _replicas(tmp_path) -> tuple[dict[str, RolloutCell], ProxyService, ProxyService]:
    cells = {f"cell-{i}": RolloutCell(f"cell-{i}", ScriptedEngineFactory()) for i in range(2)}
    for cell in cells.values():
        await cell.setup()
    store = LocalStoreClient(TrajectoryStore(tmp_path))
    codec = ChatCodec.for_model(ModelSection())

    def replica() -> ProxyService:
        clients = {cid: LocalCellClient(c) for cid, c in cells.items()}
        return ProxyService(SECTION, codec, clients, store, "token")

    return cells, replica(), replica()


async def _settle(service: ProxyService, want: set[str]) -> set[str]:
    for _ in range(200):
        if service.router.drained == want:
            break
        await asyncio.sleep(0.01)
    return set(service.router.drained)


def test_drain_and_undrain_through_one_replica_reach_the_other(tmp_path) -> None:
    async def scenario() -> None:
        cells, a, b = await _replicas(tmp_path)
        assert await b.choose_cell("e1", set()) in cells  # starts b's drain watch
        await a.drain("cell-0")
        assert cells["cell-0"].is_draining()
        assert await _settle(b, {"cell-0"}) == {"cell-0"}
        assert await b.choose_cell("e2", set()) == "cell-1"
        await a.undrain("cell-0")
        assert await _settle(b, set()) == set()
        # the scheduler drains on the cell itself: both replicas follow
        a.watch_drain_state()
        await cells["cell-1"].drain()
        assert await _settle(a, {"cell-1"}) == {"cell-1"} and await _settle(b, {"cell-1"}) == {"cell-1"}

    asyncio.run(scenario())


def test_a_replica_refused_by_a_draining_cell_routes_to_it_again_after_undrain(tmp_path) -> None:
    async def scenario() -> None:
        cells, a, b = await _replicas(tmp_path)
        b.router.drain("cell-0")  # what a refusal does to b's router
        assert not cells["cell-0"].is_draining()  # the cell itself never drained
        # starts the watch (the cell says it is not draining); meanwhile b routes around cell-0
        assert await b.choose_cell("e1", set()) == "cell-1"
        assert await _settle(b, set()) == set()
        assert await b.refresh_drain_state() == set()
        # b routes to cell-0 again: a new execution goes to the cell with no execution pinned on it,
        # and a call that must avoid cell-1 gets cell-0 instead of waiting for a routable cell
        assert await b.choose_cell("e2", set()) == "cell-0"
        assert await b.choose_cell("e3", {"cell-1"}) == "cell-0"

    asyncio.run(scenario())
