"""One model call in flight: routed to a cell, followed across drains, collected token by token.

`CallRun.tokens()` yields batches of new output ids. When the serving cell is drained it ends the
stream with the request's exported KV state; the run then asks the router for another cell and
resumes there (`resume(state)`), so the caller sees one uninterrupted stream. When a call's execution
is re-pinned away from the cell that served its last call (drained), the run first takes that cell's
staged copy of the session's cached prefix (`take_session`) and hands it to the new cell with the
request, so the prompt hits the prefix cache there. A cell that refuses
new work (draining) is skipped before anything was generated. A cell that dies (its actor is gone:
`CellUnavailable`) is marked drained in this replica's router and the call goes on elsewhere from
its recorded tokens: prompt + the output generated so far is prefilled again on the next cell (its KV
is rebuilt there) and the remaining token budget continues, so the caller still sees one stream.
Everything the policy produced (ids, log-probs, versions) is kept for the call record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyre_ray.cells.cell import Failed, Migrated, Refused, TokenBatch
from gyre_ray.engines.base import GenerateRequest, KVState, SamplingParams
from gyre_ray.proxy.clients import CellUnavailable
from gyre_ray.proxy.errors import ApiError

if TYPE_CHECKING:
    from gyre_ray.proxy.service import ProxyService

MAX_HOPS = 32  # re-routings of one call (drains, refusals, failed cells) before giving up
ABORT_WAIT_S = 5.0  # how long an abandoned call waits for its cell to let go of the request
_BACKGROUND: set[asyncio.Task] = set()  # aborts in flight, referenced until they finish


def _background(aborting: Awaitable[Any]) -> asyncio.Task:
    """Run an abort as its own task: it completes even when the call that sent it is cancelled."""

    async def run() -> None:
        with contextlib.suppress(Exception):  # the cell is gone or slow: nothing more to stop
            await asyncio.wait_for(aborting, timeout=ABORT_WAIT_S + 10)

    task = asyncio.ensure_future(run())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


@dataclass
class PreparedCall:
    """A validated call: whose it is, its role and the exact prompt ids."""

    execution_id: str
    call_id: str
    role: str
    input_ids: list[int]
    api: str
    model: str
    session: str | None = None
    parent_call_id: str | None = None
    spliced_messages: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class CallRun:
    """Generation of one call across however many cells it takes."""

    def __init__(
        self, service: ProxyService, call: PreparedCall, sampling: SamplingParams, stream: bool = True
    ) -> None:
        self.service = service
        self.call = call
        self.sampling = sampling
        self.stream = stream  # False: the cell answers once at the end (no early tokens needed)
        self.rid = f"{call.execution_id}/{call.call_id}"
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.cells: list[str] = []
        self.migrations = 0
        self.reprefills = 0  # continuations from recorded output on another cell after a cell died
        self.cached_tokens = 0  # prompt tokens the first cell served from its prefix cache
        self._cached_known = False
        self.engine_seconds = 0.0  # time the call spent inside cells (as they measured it)
        self.t_start = time.time()
        self.t_end: float | None = None
        self.current_cell: str | None = None
        self.recorded = False
        self._abort: asyncio.Task | None = None  # the abort sent to the current cell, if any

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Batches of newly generated ids until the call finishes (finish_reason is then set)."""
        state: KVState | None = None
        exclude: set[str] = set()
        try:
            for _ in range(MAX_HOPS):
                execution_id = self.call.execution_id
                pinned = self.service.router.affinity.get(execution_id)
                cell_id = await self.service.choose_cell(execution_id, exclude)
                prefix = None
                if state is None and pinned is not None and pinned != cell_id:  # the session moves
                    prefix = await self.service.take_session(pinned, execution_id)
                client = self.service.cells[cell_id]
                self.current_cell = cell_id
                self._abort = None
                self.cells.append(cell_id)
                outcome = None
                stream = None
                done = False  # the cell is through with the request (finished, moved, refused, failed)
                self.service.router.started(cell_id)
                try:
                    if state is None:
                        request = self._request()
                        if request is None:  # the budget was spent just before the cell died
                            done = True
                            self.finish_reason = "length"
                            return
                        stream = client.generate(request, self.stream, execution_id, prefix)
                    else:
                        stream = client.resume(state, self.stream, execution_id)
                    while True:
                        event = await self._next_event(stream)
                        if event is None:
                            done = True
                            break
                        if isinstance(event, TokenBatch):
                            self.engine_seconds += event.engine_seconds or 0.0
                            new = self._take(event)
                            done = self.finish_reason is not None
                            if new:
                                yield new
                            if self.finish_reason is not None:
                                break  # the final event: no need to wait for the stream's end marker
                        elif isinstance(event, Migrated):
                            done = True
                            state = event.state
                            self.engine_seconds += event.engine_seconds
                            new = self._catch_up(state)
                            if new:
                                yield new
                            self.migrations += 1
                            outcome = "migrated"
                        elif isinstance(event, Refused):
                            done = True
                            self.service.router.drain(cell_id)
                            exclude.add(cell_id)
                            outcome = "refused"
                        elif isinstance(event, Failed):
                            done = True
                            outcome = self._failed(event, cell_id, exclude)
                except CellUnavailable:  # the cell died: continue elsewhere from the recorded tokens
                    done = True
                    state = None
                    self.service.cell_failed(cell_id)
                    self.reprefills += bool(self.output_ids)  # else it simply starts elsewhere
                    outcome = "cell_lost"
                finally:
                    self.service.router.finished(cell_id)
                    self.current_cell = None
                    if not done:  # cancelled or closed mid-stream: the cell must stop it
                        self._abort_on(cell_id, wait=True)
                    if stream is not None:
                        with contextlib.suppress(Exception):
                            await stream.aclose()
                if self.finish_reason is not None:
                    return
                if outcome is None:  # the stream ended without a final event (its cell went away)
                    raise ApiError(503, f"cell {cell_id} stopped serving the call without finishing it")
            raise ApiError(503, f"the call was re-routed {MAX_HOPS} times without finishing; giving up")
        finally:
            self.t_end = time.time()

    async def cancel(self, wait: bool = False) -> None:
        """Stop generating (the client went away or a stop string was seen).

        `wait`: return once the cell has let go of the request (up to ABORT_WAIT_S), so that what
        is recorded next is final; else once the cell has taken the abort.
        """
        if self.finish_reason is None:
            self.finish_reason = "abort"
        if self.current_cell is not None:
            self._abort_on(self.current_cell, wait)
        if self._abort is not None:
            await asyncio.shield(self._abort)

    def _abort_on(self, cell_id: str, wait: bool = False) -> asyncio.Task:
        """Abort the request on `cell_id` (once per cell visit); the abort runs as its own task."""
        if self._abort is None:
            self._abort = _background(
                self.service.cells[cell_id].abort(self.rid, ABORT_WAIT_S if wait else 0.0)
            )
        return self._abort

    # ---- internals --------------------------------------------------------------------------
    def _request(self) -> GenerateRequest | None:
        """The call as a new engine request: its prompt, plus (after a lost cell) the output so far,
        with what is left of the token budget; None when nothing is left."""
        generated = len(self.output_ids)
        if not generated:
            return GenerateRequest(self.rid, self.call.input_ids, self.sampling)
        left = self.sampling.max_new_tokens - generated
        if left < 1:
            return None
        # a seeded call draws on where its lost cell stopped: the same tokens as an unbroken call
        sampling = dataclasses.replace(self.sampling, max_new_tokens=left, draws_done=generated)
        return GenerateRequest(self.rid, [*self.call.input_ids, *self.output_ids], sampling)

    async def _next_event(self, stream: AsyncIterator[Any]) -> Any:
        """The stream's next event (None at its end); past `request_timeout_s` the call is aborted.

        On a timeout the engine request is aborted first and what it had generated is still taken
        from the stream (for the record), then a 408 is raised.
        """
        limit = self.service.section.request_timeout_s
        remaining = self.t_start + limit - time.time()
        pending = asyncio.ensure_future(stream.__anext__())
        done, _ = await asyncio.wait({pending}, timeout=max(remaining, 0.001))
        if done:
            try:
                return pending.result()
            except StopAsyncIteration:
                return None
        cell = self.current_cell
        with contextlib.suppress(Exception):
            if cell is not None:
                await asyncio.shield(self._abort_on(cell))
            event = await asyncio.wait_for(pending, timeout=10)
            while True:
                if isinstance(event, TokenBatch):
                    self._take(event)
                event = await asyncio.wait_for(stream.__anext__(), timeout=10)
        pending.cancel()
        self.finish_reason = "abort"
        raise ApiError(408, f"the call ran longer than request_timeout_s = {limit:g} s and was aborted")

    def _take(self, batch: TokenBatch) -> list[int]:
        new: list[int] = []
        for event in batch.events:
            cached = getattr(event, "cached_tokens", None)
            if cached is not None and not self._cached_known:
                self.cached_tokens, self._cached_known = int(cached), True
            if event.token_id >= 0 and self.finish_reason is None:
                self.output_ids.append(event.token_id)
                self.output_logprobs.append(float(event.logprob))
                self.versions.append(int(event.version))
                new.append(event.token_id)
            if event.finish_reason is not None and self.finish_reason is None:
                self.finish_reason = event.finish_reason
        return new

    def _catch_up(self, state: KVState) -> list[int]:
        """Tokens the exported state holds that the stream had not delivered yet."""
        have = len(self.output_ids)
        extra = state.output_ids[have:]
        self.output_ids.extend(extra)
        self.output_logprobs.extend(float(x) for x in state.output_logprobs[have:])
        self.versions.extend(int(v) for v in state.output_versions[have:])
        return list(extra)

    def _failed(self, event: Failed, cell_id: str, exclude: set[str]) -> str:
        if event.kind == "input":
            raise ApiError(400, f"the model refused the request: {event.message}")
        if self.output_ids:
            raise ApiError(503, f"cell {cell_id} failed mid-generation: {event.message}")
        exclude.add(cell_id)  # nothing generated yet: try another cell
        return "failed"
