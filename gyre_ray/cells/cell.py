"""A rollout cell: one actor hosting a rollout engine, able to hand its in-flight requests to another cell.

`RolloutCell` is plain Python (run in-process by tests, or as a Ray actor by `CellPool`). Its streams
yield `TokenBatch`es (every token event available at that moment, so a remote caller pays one hop per
batch, not per token) and end in one of: the engine's final event, `Migrated(state)` (the cell was
drained: continue the request elsewhere from `state` with `resume`), `Refused` (the cell is draining
and took no new work) or `Failed` (the engine refused the request; nothing was generated).
With `stream_interval_s`, a stream's intermediate tokens go out at most that often (fewer Ray objects
per call); its first batch and whatever ends it are never held back.
The full dual-role cell (rollout <-> training) extends this class; `role` reports which is active.

Sessions (an agent's calls, named by the caller's `session` key) keep their cached prefix across a
drain: the cell remembers each session's last context; `drain()` exports the cached prefix of every
session that is not in flight and stages it through the KV transport (`transfer.kv`);
`take_session(session)` hands the ticket to whoever re-routes that session, and the cell it goes to
imports it before the session's next call (`generate(request, session, prefix=ticket)`), so that call
hits the prefix cache there. An engine without prefix export (`supports_prefix_export`) stages
nothing and the next call re-prefills; `status()["session_kv"]` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gyre_ray.engines.base import EngineInputError, GenerateRequest, KVState, RolloutEngine, TokenEvent
from gyre_ray.recent import put_recent
from gyre_ray.transfer import Ticket, Transport, make_transport
from gyre_ray.transfer.config import TransferSection

EngineFactory = Callable[[], RolloutEngine]


@dataclass
class TokenBatch:
    events: list[TokenEvent]
    engine_seconds: float | None = None  # on the batch that ends the request: its time in this cell


@dataclass
class Migrated:
    state: KVState
    engine_seconds: float = 0.0


@dataclass
class Refused:
    reason: str


@dataclass
class Failed:
    kind: str  # "input": the request is invalid for this engine; "engine": the engine failed
    message: str


CellEvent = TokenBatch | Migrated | Refused | Failed
_END = object()


@dataclass
class _InFlight:
    rid: str
    queue: asyncio.Queue
    exporting: bool = False
    state: KVState | None = None
    exported: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # the request left this cell
    session: str | None = None


class RolloutCell:
    """Hosts one rollout engine; streams, aborts, drains (exporting KV) and resumes requests."""

    def __init__(
        self,
        cell_id: str,
        engine_factory: EngineFactory,
        torch_threads: int | None = None,
        stream_interval_s: float = 0.0,
        transfer: dict[str, Any] | None = None,
        max_sessions: int = 1024,
        draining: bool = False,
    ) -> None:
        """`transfer`: the `transfer` section (dumped), whose `kv` backend stages sessions' prefixes;
        `max_sessions`: sessions whose last context the cell remembers (least recent forgotten first)."""
        # Ray warns once per process about any ray.get in an async actor, from whichever thread;
        # this actor's transfers call ray.get only inside asyncio.to_thread, off the event loop.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self.cell_id = cell_id
        self.engine_factory = engine_factory
        self.torch_threads = torch_threads
        self.engine: RolloutEngine | None = None
        self.draining = draining  # a restarted cell starts drained until it holds the current weights
        self._inflight: dict[str, _InFlight] = {}
        self._migrated_out = 0
        self._resumed_in = 0
        self.stream_interval_s = stream_interval_s
        self.transfer = TransferSection.model_validate(transfer or {})
        self.max_sessions = max_sessions
        self._transports: dict[str, Transport] = {}
        self._sessions: OrderedDict[str, array] = OrderedDict()  # session -> its last context here
        self._staged: dict[str, Ticket] = {}  # drained sessions' prefixes, until taken or undrained
        self._handed: list[Ticket] = []  # taken ones, released at undrain (their receivers fetched them)
        self.session_counters = dict.fromkeys(
            ("staged", "staged_tokens", "stage_failures", "taken", "imported_tokens", "import_failures"), 0
        )

    async def setup(self) -> dict[str, Any]:
        """Build the engine (heavy: loads the model); returns `status()`."""
        if self.torch_threads:
            import torch

            # never more threads than this node has cores (cells.cpus_per_cell=100 on 2 cores ran
            # 100 threads a cell and took 5x as long)
            torch.set_num_threads(min(self.torch_threads, os.cpu_count() or 1))
        if self.engine is None:
            self.engine = self.engine_factory()
        return self.status()

    @property
    def role(self) -> str:
        return "rollout"

    def status(self) -> dict[str, Any]:
        """Cell id, role, drain state, in-flight count and the engine's counters."""
        return {
            "cell_id": self.cell_id,
            "role": self.role,
            "draining": self.draining,
            "inflight": len(self._inflight),
            "migrated_out": self._migrated_out,
            "resumed_in": self._resumed_in,
            "session_kv": self._session_mode(),
            "sessions": {
                **self.session_counters,
                "remembered": len(self._sessions),
                "held": len(self._staged),
            },
            "engine": self.engine.stats() if self.engine is not None else {},
        }

    async def generate(
        self, request: GenerateRequest, session: str | None = None, prefix: Ticket | None = None
    ) -> AsyncIterator[CellEvent]:
        """Stream a new request of `session` (if any); `prefix`: that session's KV from the cell it left."""
        if self.draining:
            yield Refused(f"cell {self.cell_id} is draining")
            return
        if prefix is not None:
            await self._import_session(prefix)
        context = list(request.input_ids)
        serve = self._serve(request.rid, lambda: self._engine().stream(request), session, context)
        async for event in serve:
            yield event

    async def resume(self, state: KVState, session: str | None = None) -> AsyncIterator[CellEvent]:
        """Continue a request exported by another cell, from its KV state (no prefix recompute)."""
        if self.draining:
            yield Refused(f"cell {self.cell_id} is draining")
            return
        self._resumed_in += 1
        context = list(state.input_ids) + list(state.output_ids)
        async for event in self._serve(state.rid, lambda: self._engine().import_kv(state), session, context):
            yield event

    async def generate_all(
        self, request: GenerateRequest, session: str | None = None, prefix: Ticket | None = None
    ) -> list[CellEvent]:
        """`generate` collected into one reply (one remote call instead of one object per batch)."""
        return [event async for event in self.generate(request, session, prefix)]

    async def resume_all(self, state: KVState, session: str | None = None) -> list[CellEvent]:
        """`resume` collected into one reply."""
        return [event async for event in self.resume(state, session)]

    async def take_session(self, session: str) -> Ticket | None:
        """The staged prefix of a session this drained cell held (once), for the cell it moves to."""
        ticket = self._staged.pop(session, None)
        if ticket is not None:
            self.session_counters["taken"] += 1
            self._handed.append(ticket)
        return ticket

    async def forget_session(self, session: str) -> None:
        """The session is over: a drain no longer stages its prefix."""
        self._sessions.pop(session, None)

    async def abort(self, rid: str, wait_s: float = 0.0) -> bool:
        """Stop a request (its caller went away); True if it was running here.

        `wait_s`: also wait (that long at most) until the request has left the cell.
        """
        flight = self._inflight.get(rid)
        if flight is None:
            return False
        with contextlib.suppress(Exception):
            await self._engine().abort(rid)
        if wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(flight.ended.wait(), wait_s)
        return True

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Load new policy weights into the engine at its next safe point; returns `status()`."""
        await self._engine().update_weights(state_dict, version)
        return self.status()

    async def drain(self) -> int:
        """Stop taking requests and hand every in-flight one back as `Migrated`; returns how many moved."""
        self.draining = True
        flights = list(self._inflight.values())
        moved = await asyncio.gather(*(self._export(f) for f in flights))
        await self._stage_sessions(busy={f.session for f in flights})
        return sum(moved)

    async def undrain(self) -> None:
        """Take requests again; staged session prefixes (taken or not) are released."""
        self.draining = False
        tickets, self._staged, self._handed = [*self._staged.values(), *self._handed], {}, []
        for ticket in tickets:
            with contextlib.suppress(Exception):
                self._transport(ticket.backend).release(ticket)

    def is_draining(self) -> bool:
        """The cell's own drain flag: the one truth every proxy replica routes by."""
        return self.draining

    async def watch(self) -> None:
        """Never returns: a caller keeps one call pending to learn at once when this actor dies."""
        await asyncio.Event().wait()

    def close(self) -> None:
        """Stop the engine's background work, if it has any (the torch engine's loop thread)."""
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ---- internals ------------------------------------------------------------------------------
    def _engine(self) -> RolloutEngine:
        if self.engine is None:
            raise RuntimeError(f"cell {self.cell_id} has no engine: call setup() first")
        return self.engine

    def _session_mode(self) -> str:
        """How a drained session's cache reaches its next cell: "migrate" (its KV moves) or "re-prefill"."""
        engine = self.engine
        able = engine is not None and engine.supports_prefix_export and self.transfer.migrate_sessions
        return "migrate" if able else "re-prefill"

    def _transport(self, backend: str) -> Transport:
        if backend not in self._transports:
            self._transports[backend] = make_transport(backend, self.transfer, owner=self.cell_id)
        return self._transports[backend]

    def _remember(self, session: str | None, context: list[int]) -> None:
        if session is None:
            return
        put_recent(self._sessions, session, array("i", context), self.max_sessions)  # 4 bytes a token

    async def _stage_sessions(self, busy: set[str | None]) -> None:
        """Export and stage the cached prefix of every remembered session not in `busy` (those in
        flight move with their request's KV)."""
        sessions, self._sessions = self._sessions, OrderedDict()
        if self._session_mode() != "migrate":
            return
        engine, transport = self._engine(), self._transport(self.transfer.kv)
        for session, context in sessions.items():
            if session in busy:
                continue
            try:
                state = await engine.export_prefix(context.tolist())
                if state is None:
                    continue
                ticket = await asyncio.to_thread(transport.stage, state, kind="kv", version=state.version)
            except Exception:  # an engine or transport refusal: that session re-prefills
                self.session_counters["stage_failures"] += 1
                continue
            self._staged[session] = ticket
            self.session_counters["staged"] += 1
            self.session_counters["staged_tokens"] += len(state.tokens)

    async def _import_session(self, ticket: Ticket) -> None:
        """Fetch a moved session's prefix and add it to this engine's cache; on failure, re-prefill."""
        engine = self._engine()
        if self._session_mode() != "migrate":
            return
        try:
            state = await asyncio.to_thread(self._transport(ticket.backend).fetch, ticket)
            added = await engine.import_prefix(state)
            self.session_counters["imported_tokens"] += added
        except Exception:
            self.session_counters["import_failures"] += 1

    async def _export(self, flight: _InFlight) -> int:
        if flight.exporting or flight.state is not None:  # another drain is exporting it (or did)
            await flight.exported.wait()
            return 0
        flight.exporting = True
        try:
            flight.state = await self._engine().export_kv(flight.rid)
        except Exception:  # finished (or never started) meanwhile: it simply completes here
            flight.exporting = False
            return 0
        finally:
            flight.exported.set()
        self._migrated_out += 1
        flight.queue.put_nowait(_END)
        return 1

    async def _serve(
        self,
        rid: str,
        open_stream: Callable[[], AsyncIterator[TokenEvent]],
        session: str | None = None,
        context: list[int] | None = None,
    ) -> AsyncIterator[CellEvent]:
        """Stream one request; when it ends here, `context` (prompt + outputs) becomes `session`'s last."""
        if rid in self._inflight:
            yield Failed("input", f"request id {rid!r} is already in flight on cell {self.cell_id}")
            return
        if self.draining:  # checked with no await before the request is in flight: a drain that began
            # meanwhile (during a session's prefix import, say) snapshots `_inflight` without it
            yield Refused(f"cell {self.cell_id} is draining")
            return
        flight = _InFlight(rid, asyncio.Queue(), session=session)
        self._inflight[rid] = flight
        started = time.perf_counter()
        pump = asyncio.create_task(self._pump(flight, open_stream))
        finished = False
        last_yield: float | None = None  # when the previous batch went out
        held: Failed | None = None  # a failure while exporting: the caller's if the export fails too
        try:
            while not finished:
                items = [await flight.queue.get()]
                while not flight.queue.empty():
                    items.append(flight.queue.get_nowait())
                if last_yield is not None and self.stream_interval_s > 0:
                    await self._coalesce(flight, items, last_yield + self.stream_interval_s)
                events: list[TokenEvent] = []
                failure: Failed | None = None
                for item in items:
                    if item is _END:
                        finished = True
                    elif isinstance(item, Failed):
                        failure = item
                    elif not (flight.exporting and item.finish_reason == "abort"):
                        events.append(item)
                if events:
                    if context is not None:
                        context.extend(e.token_id for e in events if e.token_id >= 0)
                    final = events[-1].finish_reason is not None
                    last_yield = time.perf_counter()
                    yield TokenBatch(events, last_yield - started if final else None)
                if failure is not None and not flight.exporting:
                    yield failure
                    return
                held = failure or held
            if flight.exporting:
                await flight.exported.wait()
                if flight.state is not None:
                    yield Migrated(flight.state, time.perf_counter() - started)
                    return
            if held is not None:  # the export found the request gone: it failed here after all
                yield held
                return
            if context is not None:
                self._remember(session, context)
        finally:
            self._inflight.pop(rid, None)
            flight.ended.set()
            if not pump.done():
                pump.cancel()
                if not flight.exporting:
                    with contextlib.suppress(Exception):
                        await self._engine().abort(rid)

    @staticmethod
    async def _coalesce(flight: _InFlight, items: list[Any], until: float) -> None:
        """Gather more of a stream's items into `items` until `until`, unless the stream ends first.

        Intermediate tokens leave at most once per `stream_interval_s` (each batch costs the caller
        a Ray object); the first batch and whatever ends the stream are never held back.
        """

        def ends(item: Any) -> bool:
            return item is _END or isinstance(item, Failed) or item.finish_reason is not None

        while not any(ends(item) for item in items):
            remaining = until - time.perf_counter()
            if remaining <= 0:
                return
            getter = asyncio.ensure_future(flight.queue.get())
            try:
                await asyncio.wait({getter}, timeout=remaining)
            finally:
                waiting = not getter.done()
                if waiting:  # a get cancelled before it returned leaves its item in the queue
                    getter.cancel()
            if waiting:
                return
            items.append(getter.result())
            while not flight.queue.empty():
                items.append(flight.queue.get_nowait())

    async def _pump(self, flight: _InFlight, open_stream: Callable[[], AsyncIterator[TokenEvent]]) -> None:
        try:
            async for event in open_stream():
                flight.queue.put_nowait(event)
        except EngineInputError as exc:
            flight.queue.put_nowait(Failed("input", str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            flight.queue.put_nowait(Failed("engine", f"{type(exc).__name__}: {exc}"))
        finally:
            flight.queue.put_nowait(_END)
