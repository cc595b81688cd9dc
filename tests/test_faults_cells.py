"""Faults a run survives: a rollout cell or a training satellite dies (`ray.kill`) in the middle of a step.

One local Ray for the module, a fresh `Runtime` per test (three tiny-model dual-role cells, the
scheduler actor, `tests/fault_workload.py`'s counting harness). Each test kills a non-core cell at
the moment that hurts (calls in flight on it / gradients trained on it), lets the step finish and
checks: every execution ended valid (0 lost), every call a harness got a 200 for has its record
(0 lost), the killed cell is a new actor that serves the current version, and the update equals
what the same micro-batches give on one fault-free trainer from the same start (<= 1e-6 relative).
"""

from __future__ import annotations

import time

import pytest
import ray
from fault_workload import (
    CountingExecutor,
    check_nothing_lost,
    fault_overrides,
    reference_weights,
    relative_update_gap,
    ship_by_value,
)
from local_ray import private_ray, toy_runtime

from gyre_ray.runtime.cluster import Runtime

pytestmark = pytest.mark.slow

OVERRIDES = fault_overrides(cells=3, capacity=2)


@pytest.fixture(scope="module")
def local_ray():
    ship_by_value()
    with private_ray():
        yield


def cell_status(rt: Runtime, cell_id: str) -> dict:
    return ray.get(ray.get_actor(cell_id, namespace=rt.namespace).status.remote(), timeout=30)


def kill_when(rt: Runtime, run_ref, wanted, timeout_s: float = 300.0) -> tuple[str, str, dict]:
    """Poll the non-core cells until `wanted(status)` holds for one; kill it; returns (cell id, its
    actor id, its last status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _ = ray.wait([run_ref], timeout=0)
        assert not ready, "the step ended before the fault could be injected"
        for cell_id in ("cell-1", "cell-2"):
            status = cell_status(rt, cell_id)
            if wanted(status):
                actor = ray.get_actor(cell_id, namespace=rt.namespace)
                ray.kill(actor)
                return cell_id, actor._actor_id.hex(), status
        time.sleep(0.005)
    raise AssertionError("no cell reached the state to kill it in")


def check_rejoined(rt: Runtime, cell_id: str, old_actor: str, result: dict) -> None:
    """The killed cell is a new actor under its name, serving (undrained) the current version."""
    faults = result["faults"]
    assert [f["cell"] for f in faults] == [cell_id], faults
    assert faults[0]["restarted"] and "rejoined_at_s" in faults[0], faults
    assert ray.get_actor(cell_id, namespace=rt.namespace)._actor_id.hex() != old_actor
    status = cell_status(rt, cell_id)
    version = ray.get(rt.core.trainer_version.remote(), timeout=30)
    assert not status["draining"] and status["role"] == "rollout"
    assert status["engine"]["version"] == version


def served_by_restarted_cell(rt: Runtime, cell_id: str) -> list[str]:
    """With every other cell drained, one call through the proxy: the cells its record names."""
    import httpx

    proxy = rt.proxy
    others = [c for c in rt.pool.cell_ids if c != cell_id]
    for other in others:
        proxy.drain(other)
    try:
        created = proxy.register_execution()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {created['api_key']}"}
        reply = httpx.post(proxy.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return proxy.records(created["execution_id"])[0].meta["cells"]
    finally:
        for other in others:
            proxy.undrain(other)


def faulted_step(rt: Runtime, policy: str, wanted) -> tuple[dict, str, str, dict, float]:
    """One step under `policy` with a non-core cell killed when `wanted(its status)`; returns
    (run result, cell id, its old actor id, its last status, relative gap to the fault-free update)."""
    start = ray.get(rt.core.state_dict.remote(), timeout=60)
    version = ray.get(rt.core.trainer_version.remote(), timeout=30)
    run_ref = rt.scheduler.run.remote(1, scheduler={"policy": policy, "staleness": 0})
    cell_id, actor, status = kill_when(rt, run_ref, wanted)
    result = ray.get(run_ref, timeout=600)
    batches = ray.get(rt.scheduler.micro_batches.remote(0), timeout=60)
    final = ray.get(rt.core.state_dict.remote(), timeout=60)
    gap = relative_update_gap(start, final, reference_weights(rt, start, version, batches))
    print(f"fault {result['faults']} update gap {gap:.3g} over {len(batches)} micro-batches")
    return result, cell_id, actor, status, gap


def test_rollout_cell_dies_with_calls_in_flight(local_ray, tmp_path) -> None:
    executor = CountingExecutor(calls=4, max_tokens=24, tool_s=0.2)
    rt = toy_runtime(tmp_path, OVERRIDES, executor)
    try:
        serving = lambda s: s["role"] == "rollout" and s["inflight"] > 0  # noqa: E731
        result, cell_id, actor, _, gap = faulted_step(rt, "elastic", serving)
        reprefilled = check_nothing_lost(tmp_path, result, executions=4, calls=executor.calls)
        failures = rt.proxy.stats()["proxy"]["cell_failures"]
        print(f"calls cut by the kill: {failures}, continued from recorded tokens: {reprefilled}")
        assert failures >= 1, "a call in flight on the killed cell is re-routed (from its tokens if any)"
        check_rejoined(rt, cell_id, actor, result)
        assert gap <= 1e-6, gap
        assert served_by_restarted_cell(rt, cell_id) == [cell_id]  # the proxy found the new actor
    finally:
        rt.shutdown()


def test_satellite_dies_holding_trained_micro_batches(local_ray, tmp_path) -> None:
    executor = CountingExecutor(calls=3, max_tokens=24, tool_s=0.1)
    rt = toy_runtime(tmp_path, OVERRIDES, executor)
    try:
        trained_there = lambda s: s["role"] == "train" and s["unexported_micro_batches"] > 0  # noqa: E731
        result, cell_id, actor, old, gap = faulted_step(rt, "colocate", trained_there)
        check_nothing_lost(tmp_path, result, executions=4, calls=executor.calls)
        assert result["faults"][0]["micro_batches_requeued"] >= old["unexported_micro_batches"] >= 1
        check_rejoined(rt, cell_id, actor, result)
        assert gap <= 1e-6, gap
    finally:
        rt.shutdown()
