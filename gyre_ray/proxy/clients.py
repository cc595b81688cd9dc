"""How the proxy reaches cells and the trajectory store: in-process objects or Ray actors, one interface.

`LocalCellClient` / `LocalStoreClient` call a `RolloutCell` / `TrajectoryStore` in the same process
(unit tests, the fuzz test); `RayCellClient` / `RayStoreClient` call the same classes running as Ray
actors (the Serve deployment). The proxy's logic is written once against these. `stream=False` fetches a
call's events in one reply when nobody needs its tokens early (a non-streaming call without stop
strings): one remote call instead of one Ray object per token batch.

A cell actor that died raises `CellUnavailable` from every `RayCellClient` method; the client then
looks the actor up again by name on its next call, so a cell the runtime restarted (same name, new
actor) is reached without rebuilding the proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any

from gyre_ray.cells.cell import CellEvent, RolloutCell
from gyre_ray.engines.base import GenerateRequest, KVState
from gyre_ray.proxy.errors import root_cause
from gyre_ray.transfer import Ticket


class CellUnavailable(Exception):
    """The cell's actor is dead or unreachable (it may be restarting): try another cell."""


async def _replay(events: Awaitable[list[CellEvent]]) -> AsyncIterator[CellEvent]:
    for event in await events:
        yield event


class LocalCellClient:
    """A cell in this process."""

    def __init__(self, cell: RolloutCell) -> None:
        self.cell = cell
        self.cell_id = cell.cell_id

    def generate(
        self,
        request: GenerateRequest,
        stream: bool = True,
        session: str | None = None,
        prefix: Ticket | None = None,
    ) -> AsyncIterator[CellEvent]:
        if stream:
            return self.cell.generate(request, session, prefix)
        return _replay(self.cell.generate_all(request, session, prefix))

    def resume(
        self, state: KVState, stream: bool = True, session: str | None = None
    ) -> AsyncIterator[CellEvent]:
        return self.cell.resume(state, session) if stream else _replay(self.cell.resume_all(state, session))

    async def take_session(self, session: str) -> Ticket | None:
        return await self.cell.take_session(session)

    async def forget_session(self, session: str) -> None:
        await self.cell.forget_session(session)

    async def abort(self, rid: str, wait_s: float = 0.0) -> bool:
        return await self.cell.abort(rid, wait_s)

    async def drain(self) -> int:
        return await self.cell.drain()

    async def undrain(self) -> None:
        await self.cell.undrain()

    async def is_draining(self) -> bool:
        return self.cell.is_draining()

    async def status(self) -> dict[str, Any]:
        return self.cell.status()


class RayCellClient:
    """A cell running as a Ray actor; streams arrive as Ray streaming generators (one object per batch).

    With `name` (and `namespace`) a dead actor is looked up again by name on the next call.
    """

    def __init__(
        self, cell_id: str, actor: Any, name: str | None = None, namespace: str | None = None
    ) -> None:
        self.cell_id = cell_id
        self.actor = actor
        self.name = name
        self.namespace = namespace

    def _handle(self) -> Any:
        if self.actor is None:
            import ray

            try:
                self.actor = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:  # not (yet) restarted
                raise CellUnavailable(f"cell {self.cell_id} is not running") from None
        return self.actor

    def _lost(self, exc: BaseException) -> CellUnavailable:
        if self.name is not None:
            self.actor = None
        return CellUnavailable(f"cell {self.cell_id} is unavailable: {type(exc).__name__}")

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await getattr(self._handle(), method).remote(*args)
        except RayActorError as exc:
            raise self._lost(exc) from None

    async def _iterate(self, method: str, *args: Any) -> AsyncIterator[CellEvent]:
        from ray.exceptions import RayActorError

        try:
            async for ref in getattr(self._handle(), method).remote(*args):
                yield await ref
        except RayActorError as exc:
            raise self._lost(exc) from None

    async def _replay_remote(self, method: str, *args: Any) -> AsyncIterator[CellEvent]:
        for event in await self._call(method, *args):
            yield event

    def generate(
        self,
        request: GenerateRequest,
        stream: bool = True,
        session: str | None = None,
        prefix: Ticket | None = None,
    ) -> AsyncIterator[CellEvent]:
        if not stream:
            return self._replay_remote("generate_all", request, session, prefix)
        return self._iterate("generate", request, session, prefix)

    def resume(
        self, state: KVState, stream: bool = True, session: str | None = None
    ) -> AsyncIterator[CellEvent]:
        if not stream:
            return self._replay_remote("resume_all", state, session)
        return self._iterate("resume", state, session)

    async def take_session(self, session: str) -> Ticket | None:
        return await self._call("take_session", session)

    async def forget_session(self, session: str) -> None:
        await self._call("forget_session", session)

    async def abort(self, rid: str, wait_s: float = 0.0) -> bool:
        return await self._call("abort", rid, wait_s)

    async def drain(self) -> int:
        return await self._call("drain")

    async def undrain(self) -> None:
        await self._call("undrain")

    async def is_draining(self) -> bool:
        return await self._call("is_draining")

    async def status(self) -> dict[str, Any]:
        return await self._call("status")


class LocalStoreClient:
    """The trajectory store in this process (same async interface as the actor)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def call(self, method: str, *args: Any) -> Any:
        return getattr(self.store, method)(*args)

    def submit(self, method: str, *args: Any) -> None:
        getattr(self.store, method)(*args)


class RayStoreClient:
    """The trajectory store as a Ray actor; `submit` does not wait (calls stay ordered per caller).

    `batched`: the proxy hands records over in batches, after the response that produced them
    (an actor call costs the caller about a millisecond; an in-process store costs nothing).
    """

    batched = True

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def call(self, method: str, *args: Any) -> Any:
        """The store's answer, or the error it raised as itself: Ray's wrapper carries the actor's
        whole traceback in its text, which must never reach an HTTP client."""
        from ray.exceptions import RayTaskError

        try:
            return await getattr(self.actor, method).remote(*args)
        except RayTaskError as exc:
            cause = root_cause(exc)
            if cause is not exc and isinstance(cause, Exception):
                raise cause from None
            raise

    def submit(self, method: str, *args: Any) -> Any:
        """Send the call now (in order with every other call of this client); returns its ref (awaitable)."""
        return getattr(self.actor, method).remote(*args)
