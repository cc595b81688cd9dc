"""The proxy's core, independent of HTTP: keys, executions, token-exact prompts, routing, recording.

`ProxyService` is built once per proxy replica over a `ChatCodec`, the cells (`CellClient`s) and the
trajectory store (`StoreClient`). The HTTP front ends (`openai_api`, `anthropic_api`) only translate
request and response shapes around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any

from gyre_ray.model.chat_template import PromptTooLong
from gyre_ray.proxy.calls import CallRun, PreparedCall
from gyre_ray.proxy.clients import CellUnavailable
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.errors import ApiError
from gyre_ray.proxy.prompt import ChatPrompt, assistant_key
from gyre_ray.proxy.roles import RoleError, classify_role, system_fingerprint
from gyre_ray.proxy.router import Router
from gyre_ray.proxy.splice_cache import SpliceCache
from gyre_ray.proxy.store import StoreError
from gyre_ray.recent import put_recent
from gyre_ray.trajectory.records import CallRecord

MAIN_SYSTEMS_KEPT = 100_000  # executions whose main-agent system prompt a replica remembers
RECORD_BATCH_MAX = 256  # pending records handed to the store in one call at most
KEY_CACHE = 100_000  # API keys this replica remembers (least recently used dropped first)
KEY_TTL_S = 5.0  # a remembered key is asked of the store again after this: a finish elsewhere revokes it
SESSION_TAKE_TIMEOUT_S = 5.0  # how long a re-routed call waits for its old cell's staged prefix


def _count_down(counts: dict[str, int], execution_id: str) -> None:
    """One less for `execution_id`; no entry is kept for an execution at 0 (idle)."""
    counts[execution_id] -= 1
    if not counts[execution_id]:
        del counts[execution_id]


class _Slot:
    """One of an execution's concurrent-call slots; releasing twice is harmless."""

    def __init__(self, counts: dict[str, int], execution_id: str) -> None:
        self._counts = counts
        self._execution_id = execution_id
        self._held = True
        self.bound = False

    def release(self) -> None:
        if self._held:
            self._held = False
            _count_down(self._counts, self._execution_id)

    def bind(self, owner: object) -> None:
        """Release at the latest when `owner` (e.g. a response stream that may never run) is collected."""
        self.bound = True
        weakref.finalize(owner, self.release)


class ProxyService:
    """Everything a proxy replica does besides speaking HTTP."""

    def __init__(
        self,
        section: ProxySection,
        codec: ChatCodec,
        cells: dict[str, Any],
        store: Any,
        admin_token: str,
    ) -> None:
        self.section = section
        self.codec = codec
        self.cells = cells
        self.store = store
        self.admin_token = admin_token
        self.router = Router(list(cells))
        # key -> (execution, until when it is trusted), LRU of KEY_CACHE entries
        self._keys: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._inflight: dict[str, int] = {}
        self._waiting: dict[str, int] = {}  # calls waiting for one of the execution's slots
        self._main_system: OrderedDict[str, str] = OrderedDict()  # least recently used dropped first
        self._splices = SpliceCache()
        self._pending: list[tuple[CallRecord, str | None]] = []  # records not yet handed to the store
        self._flush: asyncio.Handle | None = None
        self._commit: asyncio.Future | None = None  # resolves once the store holds the pending batch
        self._commits: set[asyncio.Task] = set()
        self._drain_watch: asyncio.Task | None = None
        self.counters = {
            "calls": 0,
            "migrations": 0,
            "spliced_messages": 0,
            "client_aborts": 0,
            "record_batches": 0,
            "cell_failures": 0,
            "session_moves": 0,
        }

    # ---- auth ---------------------------------------------------------------------------------
    def is_admin(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode())

    async def execution_for_key(self, api_key: str | None) -> str | None:
        """The execution an API key names (None for a missing or unknown key)."""
        if not api_key:
            return None
        cached = self._keys.get(api_key)
        if cached is not None and cached[1] > time.monotonic():
            self._keys.move_to_end(api_key)
            return cached[0]
        execution_id = await self.store.call("execution_for_key", api_key)
        if execution_id is not None:
            self._cache_key(api_key, execution_id)
        else:
            self._keys.pop(api_key, None)
        return execution_id

    async def finished_execution_for_key(self, api_key: str) -> str | None:
        """The finished execution whose revoked key `api_key` was (None: never a key), to say why."""
        return await self.store.call("finished_execution_for_key", api_key)

    def _cache_key(self, api_key: str, execution_id: str) -> None:
        # the store knows every key: a miss only costs a look-up
        put_recent(self._keys, api_key, (execution_id, time.monotonic() + KEY_TTL_S), KEY_CACHE)

    # ---- admin ----------------------------------------------------------------------------------
    async def register_execution(
        self, execution_id: str | None, metadata: dict[str, Any] | None
    ) -> dict[str, str]:
        try:
            created = await self.store.call("register", execution_id, metadata)
        except StoreError as exc:
            raise ApiError(409 if "already" in str(exc) else 400, str(exc)) from None
        self._cache_key(created["api_key"], created["execution_id"])
        return created

    async def execution_summary(self, execution_id: str) -> dict[str, Any]:
        """How many calls the store holds for the execution (pending ones handed over first), and
        whether it is finished, without reading every record."""
        return await self._summary("execution_info", execution_id)

    async def records_jsonl(self, execution_id: str) -> str:
        try:
            return await self.store_read("records_jsonl", execution_id)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None

    async def close_execution(self, execution_id: str) -> dict[str, Any]:
        """Revoke the execution's key (its harness has ended; records of calls already let in are still
        added) and say how many calls the store holds for it, as `execution_summary` does. Other
        replicas stop taking the key within `KEY_TTL_S`."""
        summary = await self._summary("close_execution", execution_id)
        self._forget_keys(execution_id)
        return summary

    async def _summary(self, method: str, execution_id: str) -> dict[str, Any]:
        """The store's `method` (answering `execution_info`) on `execution_id`, as the admin API says
        it: {"execution_id", "records", "finished"}; an unknown execution is a 404."""
        try:
            info = await self.store_read(method, execution_id)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        return {"execution_id": execution_id, "records": info["num_records"], "finished": info["finished"]}

    def _forget_keys(self, execution_id: str) -> None:
        """This replica's cached keys of `execution_id` (revoked), dropped."""
        for key in [k for k, (e, _) in self._keys.items() if e == execution_id]:
            del self._keys[key]

    async def finish_execution(self, execution_id: str) -> str:
        try:
            path = await self.store_read("finish_execution", execution_id)
        except StoreError as exc:
            raise ApiError(404, str(exc)) from None
        self._forget_keys(execution_id)
        pinned = self.router.affinity.get(execution_id)
        self.router.forget(execution_id)
        if pinned is not None and hasattr(self.cells.get(pinned), "forget_session"):
            with contextlib.suppress(Exception):  # the cell only stops keeping the session for a drain
                await asyncio.wait_for(
                    self.cells[pinned].forget_session(execution_id), SESSION_TAKE_TIMEOUT_S
                )
        self._splices.forget(execution_id)
        self._main_system.pop(execution_id, None)
        return path

    async def drain(self, cell_id: str) -> int:
        """Drain a cell (its own flag) and move its in-flight calls elsewhere; returns how many moved.

        Other replicas learn it from the cell within `drain_poll_s` (or from its refusal, sooner).
        """
        self._check_cell(cell_id)
        self.router.drain(cell_id)
        moved = await self.cells[cell_id].drain()
        self.router.drain(cell_id)  # again: a poll that read the flag before the cell drained is dropped
        return moved

    async def undrain(self, cell_id: str) -> None:
        self._check_cell(cell_id)
        await self.cells[cell_id].undrain()
        self.router.undrain(cell_id)

    async def refresh_drain_state(self) -> set[str]:
        """Read every cell's own drain flag into this replica's router; returns the drained cells.

        A cell that does not answer keeps the state this replica had for it.
        """
        ids = list(self.cells)
        before = {c: self.router.changes.get(c, 0) for c in ids}
        flags = await asyncio.gather(*(self.cells[c].is_draining() for c in ids), return_exceptions=True)
        for cell_id, flag in zip(ids, flags, strict=True):
            if isinstance(flag, bool):
                self.router.observed(cell_id, flag, before[cell_id])
        return set(self.router.drained)

    def watch_drain_state(self) -> None:
        """Start (once, on the running loop) the background task that keeps the router in step with the cells."""
        loop = asyncio.get_running_loop()
        watch = self._drain_watch
        if watch is not None and not watch.done() and watch.get_loop() is loop:
            return
        self._drain_watch = loop.create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a cell restarting: try again at the next tick
                await self.refresh_drain_state()
            await asyncio.sleep(self.section.drain_poll_s)

    def cell_failed(self, cell_id: str) -> None:
        """A cell's actor is gone: route around it until its own flag says it serves again (a restart
        starts drained and is undrained once it holds the current weights)."""
        self.counters["cell_failures"] += 1
        self.router.drain(cell_id)

    async def cell_status(self) -> list[dict[str, Any]]:
        answers = await asyncio.gather(
            *(client.status() for client in self.cells.values()), return_exceptions=True
        )
        statuses = []
        for cell_id, answer in zip(self.cells, answers, strict=True):
            if isinstance(answer, CellUnavailable):
                answer = {"cell_id": cell_id, "available": False}
            elif isinstance(answer, BaseException):
                raise answer
            else:
                answer["available"] = True
            statuses.append(answer)
        for status in statuses:
            status["routable"] = status["cell_id"] not in self.router.drained
            status["proxy_load"] = self.router.load.get(status["cell_id"], 0)
        return list(statuses)

    def _check_cell(self, cell_id: str) -> None:
        if cell_id not in self.cells:
            raise ApiError(404, f"unknown cell {cell_id!r}; cells: {', '.join(self.cells)}")

    # ---- preparing a call -----------------------------------------------------------------------
    async def prepare_chat(
        self,
        execution_id: str,
        prompt: ChatPrompt,
        api: str,
        model: str,
        role_header: str | None = None,
        user_agent: str = "",
        session: str | None = None,
    ) -> PreparedCall:
        """Render the prompt token-exact (splicing recorded outputs) and classify the call's role."""
        try:
            role = classify_role(prompt, role_header, user_agent, self._main_system.get(execution_id))
        except RoleError as exc:
            raise ApiError(400, str(exc)) from None
        if execution_id in self._main_system:
            self._main_system.move_to_end(execution_id)
        elif role == "main":
            put_recent(self._main_system, execution_id, system_fingerprint(prompt), MAIN_SYSTEMS_KEPT)
        assistant_tokens, parent = await self.recorded_outputs(execution_id, prompt)
        try:
            input_ids = self.codec.prompt_ids(prompt, assistant_tokens)
        except PromptTooLong as exc:  # found without encoding it
            raise self.prompt_too_long(exc.at_least, at_least=True) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self.check_prompt_length(len(input_ids))
        self.counters["spliced_messages"] += len(assistant_tokens)
        return PreparedCall(
            execution_id=execution_id,
            call_id=new_call_id(),
            role=role,
            input_ids=input_ids,
            api=api,
            model=model,
            session=session,
            parent_call_id=parent,
            spliced_messages=len(assistant_tokens),
        )

    def prepare_ids(
        self, execution_id: str, input_ids: list[int], api: str, model: str, role_header: str | None = None
    ) -> PreparedCall:
        """A raw-token call (`/v1/completions` with token ids or text)."""
        if not input_ids:
            raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
        try:
            role = classify_role(ChatPrompt(messages=[]), role_header)
        except RoleError as exc:
            raise ApiError(400, str(exc)) from None
        self.check_prompt_length(len(input_ids), param="prompt")
        return PreparedCall(execution_id, new_call_id(), role, input_ids, api, model)

    def check_prompt_length(self, length: int, at_least: bool = False, param: str = "messages") -> None:
        """400 naming `param` when a prompt of `length` tokens (or more) leaves no room to generate."""
        if length >= self.codec.context_length:
            raise self.prompt_too_long(length, at_least, param)

    def prompt_too_long(self, length: int, at_least: bool = False, param: str = "messages") -> ApiError:
        return ApiError(
            400,
            f"the prompt is {'at least ' if at_least else ''}{length} tokens; the model's context "
            f"length is {self.codec.context_length} tokens (prompt + max_tokens must fit)",
            param,
        )

    def max_new_tokens(self, prompt_length: int, requested: int | None, param: str = "max_tokens") -> int:
        """max_tokens (the API's `param`) capped to what fits in the context; absurd values are rejected."""
        ceiling = self.section.max_tokens_ceiling
        if requested is not None and requested > ceiling:
            raise ApiError(400, f"{param} is {requested}; the most this proxy accepts is {ceiling}", param)
        room = self.codec.context_length - prompt_length
        wanted = self.section.default_max_tokens if requested is None else requested
        if self.section.max_output_tokens is not None:
            wanted = min(wanted, self.section.max_output_tokens)
        return max(1, min(wanted, room))

    async def recorded_outputs(
        self, execution_id: str, prompt: ChatPrompt
    ) -> tuple[dict[int, list[int]], str | None]:
        """Recorded output ids for assistant messages the execution's earlier calls produced."""
        wanted = {
            i: assistant_key(m.get("content"), m.get("tool_calls"))
            for i, m in enumerate(prompt.messages)
            if m["role"] == "assistant"
        }
        if not wanted:
            return {}, None
        hits = {key: self._splices.get(execution_id, key) for key in set(wanted.values())}
        missing = sorted(key for key, hit in hits.items() if hit is None)
        if missing:
            found = await self.store_read("find_outputs", execution_id, missing)
            for key, (call_id, ids) in found.items():
                self._splices.remember(execution_id, key, call_id, ids)
                hits[key] = (call_id, ids)
        spliced: dict[int, list[int]] = {}
        parent = None
        for index, key in wanted.items():
            hit = hits[key]
            if hit is not None:
                spliced[index] = hit[1]
                parent = hit[0]
        return spliced, parent

    # ---- running a call -------------------------------------------------------------------------
    async def acquire_slot(self, execution_id: str) -> _Slot:
        """Wait (up to queue_timeout_s) for one of the execution's concurrent-call slots, else 429; a
        429 at once when `max_waiting_per_execution` of its calls already wait."""
        limit = self.section.max_concurrent_per_execution
        if self._inflight.get(execution_id, 0) >= limit:
            waiting = self._waiting.get(execution_id, 0)
            if waiting >= self.section.max_waiting_per_execution:
                raise ApiError(
                    429,
                    f"execution {execution_id} already has {limit} calls in flight and {waiting} "
                    "waiting for them (the limits)",
                )
            self._waiting[execution_id] = waiting + 1
            try:
                await self._wait_for_slot(execution_id, limit)
            finally:
                _count_down(self._waiting, execution_id)
        self._inflight[execution_id] = self._inflight.get(execution_id, 0) + 1
        return _Slot(self._inflight, execution_id)

    async def _wait_for_slot(self, execution_id: str, limit: int) -> None:
        deadline = time.monotonic() + self.section.queue_timeout_s
        while self._inflight.get(execution_id, 0) >= limit:
            if time.monotonic() > deadline:
                raise ApiError(
                    429, f"execution {execution_id} already has {limit} calls in flight (the limit)"
                )
            await asyncio.sleep(0.01)

    async def choose_cell(self, execution_id: str, exclude: set[str]) -> str:
        """A routable cell, waiting up to queue_timeout_s while none is (all drained), else 503."""
        self.watch_drain_state()
        deadline = time.monotonic() + self.section.queue_timeout_s
        while True:
            cell = self.router.choose(execution_id, exclude)
            if cell is not None:
                return cell
            if time.monotonic() > deadline:
                raise ApiError(
                    503, "no rollout cell is available to serve the call (all are drained or failed)"
                )
            await asyncio.sleep(0.02)

    async def take_session(self, cell_id: str, execution_id: str) -> Any:
        """The session prefix `cell_id` staged for `execution_id` when it drained (None: none, or no answer)."""
        client = self.cells.get(cell_id)
        if client is None or not hasattr(client, "take_session"):
            return None
        try:
            ticket = await asyncio.wait_for(client.take_session(execution_id), SESSION_TAKE_TIMEOUT_S)
        except Exception:  # the old cell is gone or slow: the call re-prefills on its new cell
            return None
        if ticket is not None:
            self.counters["session_moves"] += 1
        return ticket

    def start(self, call: PreparedCall, sampling: Any, stream: bool = True) -> CallRun:
        """A call ready to run; `stream=False` when its tokens are only needed at the end."""
        self.counters["calls"] += 1
        return CallRun(self, call, sampling, stream)

    async def record_durably(
        self, run: CallRun, splice_key: str | None, meta: dict[str, Any] | None = None
    ) -> None:
        """`record`, then (with `proxy.durable_records`) wait until the store actor holds the record.

        Calls finishing together share one store call (group commit): the batch goes out right after
        the current loop iteration and every call in it returns once the store has applied it.
        """
        commit = self.record(run, splice_key, meta)
        if commit is not None:
            await asyncio.shield(commit)

    def record(
        self, run: CallRun, splice_key: str | None, meta: dict[str, Any] | None = None
    ) -> asyncio.Future | None:
        """Hand the call's record to the store (once); index its output for splicing if `splice_key`.

        Returns the future of the store's acknowledgement when `proxy.durable_records` asks for one.
        """
        if run.recorded:
            return None
        run.recorded = True
        call = run.call
        self.counters["migrations"] += run.migrations
        record = CallRecord(
            execution_id=call.execution_id,
            call_id=call.call_id,
            role=call.role,
            input_ids=list(call.input_ids),
            output_ids=list(run.output_ids),
            output_logprobs=[min(0.0, lp) for lp in run.output_logprobs],
            versions=list(run.versions),
            t_start=run.t_start,
            t_end=max(run.t_end or time.time(), run.t_start),
            parent_call_id=call.parent_call_id,
            session=call.session,
            meta={
                "api": call.api,
                "model": call.model,
                "finish_reason": run.finish_reason,
                "cells": run.cells,
                "migrations": run.migrations,
                **({"reprefills": run.reprefills} if run.reprefills else {}),
                "engine_s": round(run.engine_seconds, 6),
                "spliced_messages": call.spliced_messages,
                **call.meta,
                **(meta or {}),
            },
        )
        if splice_key is not None and run.output_ids:
            self._splices.remember(call.execution_id, splice_key, call.call_id, run.output_ids)
        self._pending.append((record, splice_key))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): hand it over now
            self.flush_records()
            return None
        batched = getattr(self.store, "batched", False)
        commit = None
        if batched and self.section.durable_records:
            if self._commit is None:
                self._commit = loop.create_future()
            commit = self._commit
        if len(self._pending) >= RECORD_BATCH_MAX or not batched:
            self.flush_records()
        elif self._flush is None:  # after this loop iteration: calls ending together share the batch
            self._flush = loop.call_soon(self.flush_records)
        return commit

    def flush_records(self) -> int:
        """Hand every pending record to the store in one call (not awaited); returns how many.

        The store applies one caller's calls in order, so any store call made after this one
        (`store_read`) sees these records.
        """
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._pending:
            return 0
        batch, self._pending = self._pending, []
        commit, self._commit = self._commit, None
        sent = self.store.submit("add_many", batch)
        if commit is not None:
            task = asyncio.ensure_future(_acknowledge(sent, commit))
            self._commits.add(task)
            task.add_done_callback(self._commits.discard)
        self.counters["record_batches"] += 1
        return len(batch)

    async def store_read(self, method: str, *args: Any) -> Any:
        """A store call that must see every call recorded so far (pending records go first)."""
        self.flush_records()
        return await self.store.call(method, *args)


async def _acknowledge(sent: Any, commit: asyncio.Future) -> None:
    """Resolve `commit` once the store call `sent` has returned (its error, if it failed).

    An in-process store applies the batch inside `submit` (nothing to await: durable already).
    """
    try:
        if inspect.isawaitable(sent):
            await sent
    except Exception as exc:
        if not commit.done():
            commit.set_exception(exc)
    else:
        if not commit.done():
            commit.set_result(None)


def new_call_id() -> str:
    """A call id: time-ordered, unique with overwhelming probability."""
    return f"call-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
