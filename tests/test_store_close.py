"""An execution's key is revoked when its harness ends (`close`), before its judge runs what the agent
left behind: no new call is let in under it, by the store (a restarted one too) or the proxy, while
the records of calls already let in are still kept until the step finishes the execution. Only that
execution's key (or the admin token) may close it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy import store_files
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.store import TrajectoryStore
from gyre_ray.trajectory.records import CallRecord

CODEC = ChatCodec.for_model(ModelSection())


def _record(execution_id: str, i: int) -> CallRecord:
    return CallRecord(
        execution_id, f"call-{i}", "main", [1, 2, i + 3], [7, 8 + i], [-0.1, -0.2], [0, 0], 1.0, 2.0
    )


@pytest.mark.parametrize("durable", [False, True])
def test_close_revokes_the_key_and_keeps_the_records_of_calls_let_in(tmp_path, durable) -> None:
    store = TrajectoryStore(tmp_path, durable=durable, fsync=False, restore=False)
    a, b = store.register("exec-a"), store.register("exec-b")
    store.add_many([(_record("exec-a", 0), "k0")])
    info = store.close_execution("exec-a")
    assert info["num_records"] == 1 and info["closed"] and not info["finished"]
    assert store.execution_for_key(a["api_key"]) is None  # no new call is let in
    assert store.finished_execution_for_key(a["api_key"]) == "exec-a"  # so the proxy can say why
    assert store.execution_for_key(b["api_key"]) == "exec-b"
    store.add_many([(_record("exec-a", 1), "k1")])  # a call let in before the close ends after it
    assert store.stats()["rejected_records"] == 0
    assert [r.call_id for r in store.records("exec-a")] == ["call-0", "call-1"]
    assert store.close_execution("exec-a")["num_records"] == 2  # closing again changes nothing
    store.finish_execution("exec-a")
    store.add_many([(_record("exec-a", 2), None)])  # finished: refused, as before
    assert store.stats()["rejected_records"] == 1
    after = store.close_execution("exec-a")  # after the finish: answered, nothing changes
    assert after["finished"] and after["closed"] and after["num_records"] == 2
    if durable:  # one close line in the registry, however often it was closed
        lines = [e for e in store_files.json_lines(tmp_path / store_files.REGISTRY_NAME) if "close" in e]
        assert lines == [{"close": "exec-a"}]


def test_a_restarted_store_keeps_a_closed_executions_key_revoked(tmp_path) -> None:
    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    a, b = store.register("exec-a"), store.register("exec-b")
    store.close_execution("exec-a")  # no record yet: a restored, empty execution
    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    assert again.execution_for_key(a["api_key"]) is None
    assert again.finished_execution_for_key(a["api_key"]) == "exec-a"
    assert again.execution_for_key(b["api_key"]) == "exec-b"
    assert again.execution_info("exec-a")["closed"] and not again.execution_info("exec-a")["finished"]
    again.add_many([(_record("exec-a", 0), None)])  # a call let in before the close
    assert [r.call_id for r in again.records("exec-a")] == ["call-0"]
    with pytest.raises(Exception, match="already registered"):
        again.register("exec-a")  # closed: never Ray's retry of a register, so never a new key


def test_an_executions_own_key_closes_it_and_is_refused_after(tmp_path) -> None:
    async def scenario() -> dict[str, Any]:
        lp = await build_local_proxy(CODEC, ScriptedEngineFactory(), tmp_path, num_cells=1)
        a, b = lp.register_execution("exec-a"), lp.register_execution("exec-b")
        admin = {"Authorization": f"Bearer {lp.admin_token}"}
        key_a, key_b = ({"Authorization": f"Bearer {e['api_key']}"} for e in (a, b))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        out: dict[str, Any] = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lp.app), base_url="http://a") as c:
            out["call"] = (await c.post("/v1/chat/completions", json=body, headers=key_a)).status_code
            other = await c.post("/gyre/executions/exec-a/close", headers=key_b)
            out["other"] = other.status_code, other.json()["error"]["message"]
            out["close"] = (await c.post("/gyre/executions/exec-a/close", headers=key_a)).json()
            late = await c.post("/v1/chat/completions", json=body, headers=key_a)
            out["late"] = late.status_code, late.json()["error"]["message"]
            out["b"] = (await c.post("/v1/chat/completions", json=body, headers=key_b)).status_code
            out["admin"] = (await c.post("/gyre/executions/exec-b/close", headers=admin)).status_code
            out["b_after"] = (await c.post("/v1/chat/completions", json=body, headers=key_b)).status_code
            out["records"] = (await c.get("/gyre/executions/exec-a/records", headers=admin)).text
        for cell in lp.cells.values():
            cell.close()
        return out

    out = asyncio.run(scenario())
    assert out["call"] == out["b"] == out["admin"] == 200
    assert out["other"] == (403, "an execution's key may read or close only its own execution")
    assert out["close"] == {"execution_id": "exec-a", "records": 1, "finished": False}
    assert out["late"] == (401, "invalid API key: execution 'exec-a' has ended (its key is revoked)")
    assert out["b_after"] == 401
    assert len(out["records"].splitlines()) == 1  # kept for the step


def test_the_runner_closes_the_key_before_the_judge_runs(exec_tmp, tmp_path) -> None:
    """A harness that writes its key into its workspace: its own call is recorded and counted, and
    when the judge runs, a call with that key (what code the agent left could make) is refused."""
    import json
    import sys
    import urllib.error
    import urllib.request

    from served_proxy import ServedProxy

    from gyre_ray.agents.runner import Endpoint, run_execution
    from gyre_ray.envs.base import EvalResult, Task
    from gyre_ray.proxy.config import ProxySection

    served = ServedProxy(ScriptedEngineFactory(), tmp_path, ProxySection())
    try:
        key = served.proxy.register_execution("exec-a")["api_key"]
        harness = (
            "import json, os, urllib.request\n"
            "open('key.txt', 'w').write(os.environ['GYRE_API_KEY'])\n"
            "body = json.dumps({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4})\n"
            "request = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', body.encode(),\n"
            "    {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
            "urllib.request.urlopen(request, timeout=30).read()\n"
        )
        judged: list[tuple[int, str]] = []

        def judge(workspace) -> EvalResult:  # what the agent's code could do while it is judged
            body = {"model": "tiny", "messages": [{"role": "user", "content": "more"}], "max_tokens": 4}
            left = (workspace / "key.txt").read_text()
            request = urllib.request.Request(
                served.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                {"Authorization": f"Bearer {left}", "Content-Type": "application/json"},
            )  # fmt: skip
            try:
                urllib.request.urlopen(request, timeout=30)
                judged.append((200, ""))
            except urllib.error.HTTPError as exc:
                judged.append((exc.code, json.loads(exc.read())["error"]["message"]))
            return EvalResult(1.0)

        out = run_execution(
            "exec-a", Task("t", "x", evaluate=judge), Endpoint(served.base_url, key), exec_tmp / "ws",
            command=[sys.executable, "-c", harness], timeout_s=60, require_calls=True,
        )  # fmt: skip
        records = served.proxy.store.records("exec-a")
    finally:
        served.close()
    assert out.valid and out.exit_code == 0 and out.calls == 1
    assert judged == [(401, "invalid API key: execution 'exec-a' has ended (its key is revoked)")]
    assert len(records) == 1  # the harness's call only
