"""The record store closes a finished execution: its key is revoked (a restarted store too), nothing is
added to it any more, and a restarted store does not read its file back. Execution ids are matched
whole (no trailing newline)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy import service as service_module
from gyre_ray.proxy import store_files
from gyre_ray.proxy.app import build_app
from gyre_ray.proxy.clients import LocalStoreClient
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.service import ProxyService
from gyre_ray.proxy.store import StoreError, TrajectoryStore
from gyre_ray.trajectory.records import CallRecord


def _record(execution_id: str, i: int) -> CallRecord:
    return CallRecord(
        execution_id, f"call-{i}", "main", [1, 2, i + 3], [7, 8 + i], [-0.1, -0.2], [0, 0], 1.0, 2.0
    )


def _lines(path: Path) -> list[str]:
    return [json.loads(line)["call_id"] for line in path.read_text().splitlines()]


# ---- finish revokes the key and closes the execution ---------------------------------------------------
@pytest.mark.parametrize("durable", [False, True])
def test_finish_revokes_the_key_and_refuses_later_records(tmp_path, durable) -> None:
    store = TrajectoryStore(tmp_path, durable=durable, fsync=False, restore=False)
    a, b = store.register("exec-a"), store.register("exec-b")
    store.add_many([(_record("exec-a", 0), "k0"), (_record("exec-b", 0), None)])
    path = Path(store.finish_execution("exec-a"))
    assert store.execution_for_key(a["api_key"]) is None  # as an unknown key
    assert store.finished_execution_for_key(a["api_key"]) == "exec-a"  # so the proxy can say why
    assert store.finished_execution_for_key(b["api_key"]) is None
    assert store.finished_execution_for_key("gyre-nope") is None
    assert store.execution_for_key(b["api_key"]) == "exec-b"

    store.add_many([(_record("exec-a", 1), "k1"), (_record("exec-b", 1), None)])  # one late record
    assert store.stats()["rejected_records"] == 1
    if not durable:
        with pytest.raises(StoreError, match="execution 'exec-a' has finished"):
            store.add(_record("exec-a", 2))
    assert _lines(path) == ["call-0"]
    assert [r.call_id for r in store.records("exec-a")] == ["call-0"]
    assert [r.call_id for r in store.records("exec-b")] == ["call-0", "call-1"]
    assert store.execution_info("exec-a") == {
        "execution_id": "exec-a",
        "metadata": {},
        "closed": True,
        "finished": True,
        "num_records": 1,
    }
    assert store.find_outputs("exec-a", ["k0", "k1"]) == {}
    assert store.execution_for_key(a["api_key"]) is None
    assert store.finish_execution("exec-a") == str(path)  # finishing again is harmless
    with pytest.raises(StoreError, match="already registered"):
        store.register("exec-a")


def test_a_restarted_store_keeps_a_finished_executions_key_revoked_and_its_records_closed(tmp_path) -> None:
    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    a, b = store.register("exec-a"), store.register("exec-b")
    store.add_many([(_record("exec-a", i), f"k{i}") for i in range(3)] + [(_record("exec-b", 0), None)])
    store.finish_execution("exec-a")

    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert again.execution_for_key(a["api_key"]) is None
    assert again.finished_execution_for_key(a["api_key"]) == "exec-a"
    assert again.execution_for_key(b["api_key"]) == "exec-b"
    again.add_many([(_record("exec-a", 3), None), (_record("exec-b", 1), None)])
    assert again.stats()["rejected_records"] == 1
    assert [r.call_id for r in again.records("exec-a")] == ["call-0", "call-1", "call-2"]
    assert again.execution_info("exec-a")["num_records"] == 3 and again.stats()["records"] == 5
    with pytest.raises(StoreError, match="already registered"):
        again.register("exec-a")  # finished: never Ray's retry of a register
    third = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert third.execution_for_key(a["api_key"]) is None and third.execution_for_key(b["api_key"]) == "exec-b"


# ---- a restart reads only the files it needs -----------------------------------------------------------
def test_a_restarted_store_reads_no_finished_executions_file(tmp_path, monkeypatch) -> None:
    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    store.register("exec-done")
    store.register("exec-live")
    store.add_many([(_record("exec-done", i), f"d{i}") for i in range(4)])
    store.add_many([(_record("exec-live", i), f"l{i}") for i in range(2)])
    store.finish_execution("exec-done")
    assert json.loads((tmp_path / ".registry.jsonl").read_text().splitlines()[-1]) == {
        "finish": "exec-done",
        "records": 4,
    }

    read: list[str] = []
    real_open = open

    def watching_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        read.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watching_open)
    real_read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read.append(p.name) or real_read_bytes(p))
    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    monkeypatch.undo()
    assert "exec-done.jsonl" not in read and "exec-live.jsonl" in read
    assert again.execution_info("exec-done")["num_records"] == 4
    assert [r.call_id for r in again.records("exec-done")] == [f"call-{i}" for i in range(4)]
    assert again.find_outputs("exec-live", ["l1"]) == {"l1": ("call-1", [7, 9])}  # unfinished: as before
    again.add_many([(_record("exec-live", 1), None)])
    assert again.stats()["duplicate_records"] == 1


def test_a_finish_line_without_a_count_is_counted_from_the_file_unparsed(tmp_path) -> None:
    """A registry an older store wrote has `{"finish": id}` only: the records are counted, not parsed,
    and a torn last line is cut off as `scan_records` cuts it."""
    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    store.register("exec-old")
    store.add_many([(_record("exec-old", i), None) for i in range(3)])
    store.finish_execution("exec-old")
    registry = tmp_path / ".registry.jsonl"
    registry.write_text(registry.read_text().replace(', "records": 3', ""))
    path = tmp_path / "exec-old.jsonl"
    intact = path.read_bytes()
    with open(path, "ab") as fh:
        fh.write(b'{"execution_id": "exec-old", "call_id": "call-9", "ro')
    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert again.execution_info("exec-old")["num_records"] == 3
    assert path.read_bytes() == intact
    assert [r.call_id for r in again.records("exec-old")] == ["call-0", "call-1", "call-2"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\n",
        b"{}\n",
        b"  \n\n{}\n \t\n{}\n",
        b"{}\n{}",
        b"{}\n   ",
        b"\n\n\n{}",
        b"{}\n" * 5 + b'{"call_id"',
        b'{"chunk": "ab", "ids": []}\n{}\n{"chunk": "cd", "ids": []}\n{}\n',  # chunk lines are no records
        b'{}\n{"chunk": "ab", "ids": [1, 2, 3]}',
    ],
)
def test_count_records_counts_and_cuts_as_scan_records_does(tmp_path, chunk, content) -> None:
    scanned, counted = tmp_path / "scanned.jsonl", tmp_path / "counted.jsonl"
    scanned.write_bytes(content.replace(b"{}", b'{"call_id": "c"}'))
    counted.write_bytes(content.replace(b"{}", b'{"call_id": "c"}'))
    count, _ = store_files.scan_records(scanned)
    assert store_files.count_records(counted, chunk=chunk) == count
    assert counted.read_bytes() == scanned.read_bytes()
    assert store_files.count_records(tmp_path / "absent.jsonl") == 0


# ---- execution ids ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["exec-a\n", "exec-a\r\n", "\nexec-a", "exec a", ".hidden", "", "a" * 129])
def test_execution_ids_are_matched_whole(tmp_path, bad) -> None:
    store = TrajectoryStore(tmp_path)
    with pytest.raises(StoreError, match="must match"):
        store.register(bad)
    assert store.list_executions() == [] and not list(tmp_path.iterdir())
    assert store.register("a" * 128)["execution_id"] == "a" * 128


# ---- through the proxy ------------------------------------------------------------------------------------
CODEC = ChatCodec.for_model(ModelSection())


def test_after_finish_a_call_with_the_key_is_refused_and_not_recorded(tmp_path, monkeypatch) -> None:
    """Replica A served the execution and finishes it: it forgets the key at once. Replica B saw the
    key before the finish; it trusts what it remembers for `KEY_TTL_S` only (0 here), then asks the
    store, which names the finished execution."""

    async def scenario() -> dict[str, Any]:
        lp = await build_local_proxy(CODEC, ScriptedEngineFactory(), tmp_path, num_cells=1)
        other = ProxyService(
            lp.service.section, CODEC, lp.service.cells, LocalStoreClient(lp.store), lp.admin_token
        )
        created = lp.register_execution("exec-a")
        admin = {"Authorization": f"Bearer {lp.admin_token}"}
        mine = {"Authorization": f"Bearer {created['api_key']}"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        out: dict[str, Any] = {}
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=lp.app), base_url="http://a") as a,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(other)), base_url="http://b") as b,
        ):
            out["before"] = (await a.post("/v1/chat/completions", json=body, headers=mine)).status_code
            out["before_b"] = (await b.post("/v1/chat/completions", json=body, headers=mine)).status_code
            out["finish"] = (await a.post("/gyre/executions/exec-a/finish", headers=admin)).status_code
            after_b = await b.post("/v1/chat/completions", json=body, headers=mine)
            out["after_b"] = after_b.status_code, after_b.json()["error"]["message"]
            after_a = await a.post("/v1/chat/completions", json=body, headers=mine)
            out["after_a"] = after_a.status_code, after_a.json()["error"]["message"]
            out["stats"] = (await a.get("/gyre/stats", headers=admin)).json()["store"]
            out["records"] = (await a.get("/gyre/executions/exec-a/records", headers=admin)).text
        for cell in lp.cells.values():
            cell.close()
        return out

    monkeypatch.setattr(service_module, "KEY_TTL_S", 0.0)
    out = asyncio.run(scenario())
    assert out["before"] == out["before_b"] == out["finish"] == 200
    refused = (401, "invalid API key: execution 'exec-a' has ended (its key is revoked)")
    assert out["after_a"] == out["after_b"] == refused
    assert out["stats"]["rejected_records"] == 0
    assert len(out["records"].splitlines()) == 2  # the calls before the finish only


def test_after_finish_the_replica_that_served_the_execution_refuses_its_key_too(tmp_path) -> None:
    """With the default KEY_TTL_S (the test above sets 0): the replica the finish went through forgets
    the key at once, not after its cache lifetime."""

    async def scenario() -> int:
        lp = await build_local_proxy(CODEC, ScriptedEngineFactory(), tmp_path, num_cells=1)
        created = lp.register_execution("exec-a")
        admin = {"Authorization": f"Bearer {lp.admin_token}"}
        mine = {"Authorization": f"Bearer {created['api_key']}"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lp.app), base_url="http://a") as a:
            assert (await a.post("/v1/chat/completions", json=body, headers=mine)).status_code == 200
            assert (await a.post("/gyre/executions/exec-a/finish", headers=admin)).status_code == 200
            late = await a.post("/v1/chat/completions", json=body, headers=mine)
        for cell in lp.cells.values():
            cell.close()
        return late.status_code, late.text

    status, text = asyncio.run(scenario())
    assert status == 401 and "execution 'exec-a' has ended" in text
