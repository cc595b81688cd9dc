"""Fault handling without Ray: a cell that dies mid-call, no cell left, the queue undoing a lost micro-batch.

The proxy runs in-process over scripted engines, whose next token is a pure function of the context:
a call continued on another cell from its recorded tokens must produce exactly the tokens of the
same call left alone. A `DyingCell` client behaves like a cell actor that was killed after sending
some token batches (its stream and every later call raise `CellUnavailable`).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.cells.scripted_engine import ScriptedEngine
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.clients import CellUnavailable, LocalCellClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.runtime.stream import MicroBatchStream

CODEC = ChatCodec.for_model(ModelSection())
SECTION = ProxySection(queue_timeout_s=0.5, drain_poll_s=0.02)
MESSAGES = [{"role": "user", "content": "write the parser"}]


class DyingCell(LocalCellClient):
    """A cell whose actor dies after `batches` token batches of its next stream (then stays dead)."""

    def __init__(self, inner: LocalCellClient, batches: int) -> None:
        super().__init__(inner.cell)
        self.batches = batches
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise CellUnavailable(f"cell {self.cell_id} is unavailable: ActorDiedError")

    def generate(self, request, stream: bool = True, *session):
        return self._dying(lambda: super(DyingCell, self).generate(request, stream, *session))

    def resume(self, state, stream: bool = True, *session):
        return self._dying(lambda: super(DyingCell, self).resume(state, stream, *session))

    async def _dying(self, open_events):
        self._check()
        events, sent = open_events(), 0
        async for event in events:
            if sent == self.batches:
                self.dead = True
                await events.aclose()
                self._check()
            yield event
            sent += 1

    async def abort(self, rid: str, wait_s: float = 0.0) -> bool:
        self._check()
        return await super().abort(rid, wait_s)

    async def is_draining(self) -> bool:
        self._check()
        return await super().is_draining()

    async def status(self) -> dict:
        self._check()
        return await super().status()


class RecordingCell(LocalCellClient):
    """A live cell that keeps the requests it was sent."""

    def __init__(self, inner: LocalCellClient) -> None:
        super().__init__(inner.cell)
        self.requests: list = []

    def generate(self, request, stream: bool = True, *session):
        self.requests.append(request)
        return super().generate(request, stream, *session)


def new_proxy(tmp_path):
    factory = ScriptedEngineFactory({"reply_length": 40, "token_delay_s": 0.002})
    return asyncio.run(build_local_proxy(CODEC, factory, tmp_path, section=SECTION))


async def chat(proxy, api_key: str, stream: bool) -> httpx.Response:
    transport = httpx.ASGITransport(app=proxy.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as http:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "stream": stream, "temperature": 0}
        return await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        )


def scripted_continuation(prompt: list[int], n: int) -> list[int]:
    """What a scripted engine generates for `prompt` (n tokens at most): a re-prefilled continuation."""
    engine, out = ScriptedEngine(reply_length=40), []
    while len(out) < n:
        out.append(engine.next_token(prompt, out, CODEC.stop_ids, None))
        if out[-1] in CODEC.stop_ids:
            break
    return out


@pytest.mark.parametrize(("stream", "batches"), [(True, 3), (False, 0)])
def test_a_call_on_a_cell_that_dies_continues_elsewhere_from_its_tokens(tmp_path, stream, batches) -> None:
    proxy = new_proxy(tmp_path)
    alone = proxy.register_execution("alone")
    assert asyncio.run(chat(proxy, alone["api_key"], stream)).status_code == 200
    (reference,) = proxy.store.records("alone")
    proxy.service.router.forget("alone")

    dying = DyingCell(proxy.service.cells["cell-0"], batches=batches)
    proxy.service.cells["cell-0"] = dying
    survivor = proxy.service.cells["cell-1"] = RecordingCell(proxy.service.cells["cell-1"])
    hit = proxy.register_execution("hit")
    reply = asyncio.run(chat(proxy, hit["api_key"], stream))
    assert reply.status_code == 200, reply.text
    (record,) = proxy.store.records("hit")
    assert dying.dead and record.meta["cells"] == ["cell-0", "cell-1"]
    assert len(record.output_ids) == len(record.output_logprobs) == len(record.versions) == 30
    assert "cell-0" in proxy.service.router.drained and proxy.service.counters["cell_failures"] == 1
    if not batches:  # nothing had been generated: the call simply ran on the other cell
        assert record.output_ids == reference.output_ids and "reprefills" not in record.meta
        return
    assert record.meta["reprefills"] == 1
    (continued,) = survivor.requests  # a seeded call's generator skips the draws the dead cell made
    assert continued.sampling.draws_done == len(continued.input_ids) - len(record.input_ids) >= batches
    out, ref = record.output_ids, reference.output_ids
    kept = next(k for k in range(len(out)) if out[k] != ref[k])  # tokens that came from the dead cell
    assert kept >= batches
    assert out[kept:] == scripted_continuation(record.input_ids + out[:kept], 30 - kept)


def test_no_live_cell_is_a_retryable_503_not_a_hang(tmp_path) -> None:
    proxy = new_proxy(tmp_path)
    for cell_id, client in list(proxy.service.cells.items()):
        proxy.service.cells[cell_id] = dead = DyingCell(client, batches=0)
        dead.dead = True
    created = proxy.register_execution()
    started = time.monotonic()
    replies = [asyncio.run(chat(proxy, created["api_key"], stream)) for stream in (False, True)]
    assert time.monotonic() - started < 2 * SECTION.queue_timeout_s + 10
    for reply in replies:
        assert reply.status_code == 503 and reply.headers["retry-after"] == str(SECTION.retry_after_s)
        assert "retry" in reply.text.lower() or "cell" in reply.text.lower()

    async def cells() -> httpx.Response:
        transport = httpx.ASGITransport(app=proxy.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return await http.get("/gyre/cells", headers={"Authorization": f"Bearer {proxy.admin_token}"})

    listing = asyncio.run(cells())
    assert listing.status_code == 200
    assert [c["available"] for c in listing.json()["cells"]] == [False, False]


def test_untrain_puts_a_lost_micro_batch_first_in_line_and_the_step_is_incomplete_again() -> None:
    stream = MicroBatchStream()
    for i in range(3):
        stream.put(f"b{i}", [f"e{i}"])
    stream.seal()
    for cell in ("cell-1", "cell-2", "cell-1"):
        item = stream.claim(cell)
        stream.trained(item.index, cell)
    assert stream.complete
    stream.untrain(0)
    assert (
        not stream.complete and stream.queued == 1 and stream.trained_by_cell() == {"cell-1": 1, "cell-2": 1}
    )
    again = stream.claim("cell-0")
    assert again.index == 0
    stream.trained(0, "cell-0")
    assert stream.complete and stream.scale() == pytest.approx(1 / 3)
    fresh = MicroBatchStream()
    fresh.put("x", ["e"])
    with pytest.raises(RuntimeError, match="not trained"):
        fresh.untrain(0)


def _store_record(execution_id: str, i: int):
    from gyre_ray.trajectory.records import CallRecord

    return CallRecord(
        execution_id, f"call-{i}", "main", [1, 2, i + 3], [7, 8 + i], [-0.1, -0.2], [0, 0], 1.0, 2.0
    )


def test_a_durable_store_started_again_on_its_folder_has_every_record_key_and_splice(tmp_path) -> None:
    """The store actor's process dies: a new store on the same folder (what Ray's restart runs) holds
    every applied record, knows every key, splices as before; a batch sent again is not doubled, and
    a record torn mid-write (never acknowledged) is cut off."""
    from gyre_ray.proxy.store import StoreError, TrajectoryStore

    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    a, b = store.register("exec-a"), store.register("exec-b")
    batch = [(_store_record("exec-a", i), f"key-{i}") for i in range(3)] + [
        (_store_record("exec-b", 0), None)
    ]
    store.add_many(batch)
    store.finish_execution("exec-b")
    assert store.stats()["records_in_memory"] == 0  # nothing waits in memory
    with open(tmp_path / "exec-a.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"execution_id": "exec-a", "call_id": "call-9", "ro')  # the writer killed mid-line

    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert again.execution_for_key(a["api_key"]) == "exec-a"
    assert again.execution_for_key(b["api_key"]) is None  # finished: its key stays revoked
    assert again.finished_execution_for_key(b["api_key"]) == "exec-b"
    assert again.execution_for_key("gyre-nope") is None
    again.add_many(batch[1:3] + [(_store_record("exec-a", 3), None)])  # Ray's retry of a half-applied batch
    assert [r.call_id for r in again.records("exec-a")] == [f"call-{i}" for i in range(4)]
    assert [r.call_id for r in again.records("exec-b")] == ["call-0"]
    assert again.execution_info("exec-b")["finished"]
    assert again.stats()["duplicate_records"] == 2
    assert again.find_outputs("exec-a", ["key-1"]) == {"key-1": ("call-1", [7, 9])}
    assert not any("gyre-" in line for line in (tmp_path / ".registry.jsonl").read_text().splitlines())
    with pytest.raises(StoreError, match="already registered"):
        again.register("exec-a")  # it has records: a true duplicate
    again.register("exec-c")
    third = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    retried = third.register("exec-c")  # registered, never answered: Ray's retry gets a fresh key
    assert third.execution_for_key(retried["api_key"]) == "exec-c"
    assert (
        TrajectoryStore(tmp_path, durable=True, restore=True).execution_for_key(retried["api_key"])
        == "exec-c"
    )
    fresh = TrajectoryStore(tmp_path, durable=True)  # a new store (a new or resumed run) starts afresh
    assert fresh.list_executions() == [] and fresh.execution_for_key(retried["api_key"]) is None


def _asgi_app(*messages, raise_after: bool = True):
    async def app(scope, receive, send):
        for message in messages:
            await send(message)
        if raise_after:
            raise RuntimeError("the replica died")  # what Serve's proxy raises: RayActorError

    return app


@pytest.mark.parametrize(
    ("messages", "status", "tail"),
    [
        ((), 503, None),  # nothing answered
        (({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]},
          {"type": "http.response.body", "body": b"Internal Server Error"}), 503, None),  # Serve's own 500
        (({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
          {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True}), 200, "[DONE]"),
    ],
)  # fmt: skip
def test_a_call_cut_by_a_dead_replica_is_a_retryable_error(messages, status, tail) -> None:
    from gyre_ray.proxy.serve_errors import ReplicaLossMiddleware

    app = ReplicaLossMiddleware(_asgi_app(*messages), retry_after_s=2)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/chat/completions", json={})

    reply = asyncio.run(call())
    assert reply.status_code == status
    if status == 503:
        assert reply.headers["retry-after"] == "2"
        assert reply.json()["error"]["type"] == "service_unavailable"
    else:  # the stream ends with an error event in the OpenAI shape, then [DONE]
        events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert '"service_unavailable"' in events[-2] and events[-1].endswith(tail)


def test_the_apps_own_answers_pass_the_replica_loss_middleware() -> None:
    from gyre_ray.proxy.serve_errors import ReplicaLossMiddleware

    own = ({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]},
           {"type": "http.response.body", "body": b'{"error": {}}'})  # fmt: skip
    app = ReplicaLossMiddleware(_asgi_app(*own, raise_after=False))

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/messages", json={})

    reply = asyncio.run(call())
    assert reply.status_code == 500 and reply.json() == {"error": {}}


def test_the_scheduler_journal_replays_only_its_own_run_and_stops_at_a_torn_line(tmp_path) -> None:
    from gyre_ray.runtime.journal import RunJournal

    header = {"steps": 2, "first_step": 0, "tag": "s-"}
    journal = RunJournal.begin(tmp_path, header, 3)
    journal.launched(0, 1)
    journal.launched(1, 2)
    journal.ended(0, {"execution_id": "s-0", "reward": 1.0})
    journal.fault({"cell": "cell-2", "lost": "ActorDiedError"})
    journal.published(0, 4, {"step": 0})
    journal.close()
    with open(tmp_path / "scheduler-journal.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"ended": 1, "outco')  # the scheduler killed mid-write
    state = RunJournal.replay(tmp_path, header)
    assert state.start_version == 3 and state.launched == {0: 1, 1: 2}
    assert state.outcomes == {0: {"execution_id": "s-0", "reward": 1.0}}  # execution 1 still running
    assert state.published == [{"batch": 0, "version": 4, "metrics": {"step": 0}}]
    assert state.faults == [{"cell": "cell-2", "lost": "ActorDiedError"}]
    assert RunJournal.replay(tmp_path, {**header, "tag": "other-"}) is None  # another run's journal
    RunJournal.begin(tmp_path, header, 4).close()  # a new run starts the journal afresh
    assert RunJournal.replay(tmp_path, header).launched == {}


def test_a_journal_names_the_call_to_resume_only_for_its_runtime_and_while_steps_are_left(tmp_path) -> None:
    from gyre_ray.runtime.journal import RunJournal

    call = {"namespace": "gyre-a", "steps": 2, "options": {"first_step": 0, "checkpoint_every": 1}}
    journal = RunJournal.begin(tmp_path, {"steps": 2, "first_step": 0, "tag": ""}, 0, call)
    assert RunJournal.unfinished_call(tmp_path, "gyre-a") == call
    assert RunJournal.unfinished_call(tmp_path, "gyre-b") is None  # another runtime's run (a resumed segment)
    journal.published(0, 1, {"step": 0})
    assert RunJournal.unfinished_call(tmp_path, "gyre-a") == call
    journal.published(1, 2, {"step": 1})
    journal.close()
    assert RunJournal.unfinished_call(tmp_path, "gyre-a") is None  # every step published: nothing to resume
    RunJournal.begin(tmp_path, {"steps": 2, "first_step": 0, "tag": ""}, 0).close()  # a run with no call
    assert RunJournal.unfinished_call(tmp_path, "gyre-a") is None


def test_a_started_run_is_joined_by_a_run_call_with_its_key_and_a_failure_reaches_join() -> None:
    import threading

    from gyre_ray.runtime.run_keeper import RunKeeper

    keeper, release, calls = RunKeeper(), threading.Event(), []

    def body() -> str:
        calls.append(1)
        release.wait(10)
        return "done"

    keeper.start("k", body)
    assert keeper.state() == {"key": "k", "running": True, "failed": False}
    with pytest.raises(RuntimeError, match="another run is under way"):
        keeper.start("other", body)
    waiter = threading.Thread(target=lambda: calls.append(keeper.run("k", body)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and calls == [1]  # the retried `run` waits for the started run
    release.set()
    waiter.join(10)
    assert calls == [1, "done"] and keeper.state()["running"] is False  # body ran once
    assert keeper.run("k", lambda: "again") == "again"  # a run ended: the same key starts anew

    def fails() -> None:
        raise ValueError("boom")

    keeper.start("bad", fails)
    with pytest.raises(ValueError, match="boom"):
        keeper.join("bad", body, timeout_s=10)


def test_a_full_disk_fails_the_batch_and_leaves_the_file_whole(tmp_path, monkeypatch) -> None:
    """A write that comes back short is carried on; one that fails (ENOSPC) is cut back to where the
    file ended and fails the batch, whose records are not booked: the batch sent again is taken, and
    the file reads back whole (a torn line followed by later ones made every read of it fail)."""
    import errno
    import os

    from gyre_ray.proxy import store_files
    from gyre_ray.proxy.store import TrajectoryStore

    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    store.register("exec-a")
    store.add_many([(_store_record("exec-a", 0), None)])
    real_write = os.write
    plan = ["short", "full"]

    def flaky_write(fd: int, data) -> int:
        step = plan.pop(0) if plan else "ok"
        if step == "short":  # half of it, then the rest on the next call
            return real_write(fd, bytes(data[: max(1, len(data) // 2)]))
        if step == "full":
            real_write(fd, bytes(data[:7]))  # a torn piece, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(store_files.os, "write", flaky_write)
    with pytest.raises(OSError, match="No space left"):
        store.add_many([(_store_record("exec-a", 1), None)])  # short write carried on, then full
    monkeypatch.setattr(store_files.os, "write", real_write)
    assert [r.call_id for r in store.records("exec-a")] == ["call-0"]
    store.add_many([(_store_record("exec-a", 1), None), (_store_record("exec-a", 2), None)])  # sent again
    assert [r.call_id for r in store.records("exec-a")] == ["call-0", "call-1", "call-2"]
    assert store.stats()["duplicate_records"] == 0
    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert [r.call_id for r in again.records("exec-a")] == ["call-0", "call-1", "call-2"]
