"""The runtime on real Ray cells: named actors, pipelined steps under eta, true async, elastic returns.

One local Ray + Serve and one `Runtime` for the module: three tiny-model dual-role cells behind the proxy,
the `scheduler` actor, and the test-only long-tailed workload (`tests/longtail_workload.py`: model calls
between tool-call sleeps, durations from the nl2repo preset scaled to seconds). Several runs follow
each other on the same cells. The records of every execution (each token's policy version) prove
what overlapped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from local_ray import private_ray, toy_runtime
from longtail_workload import LongTailExecutor, ship_by_value

from gyre_ray.trajectory.records import read_jsonl

pytestmark = pytest.mark.slow

OVERRIDES = [
    "cells.num_cells=3",
    "cells.cpus_per_cell=0.5",
    "cells.capacity=2",
    "proxy.port=0",
    "run.tasks_per_step=2",
    "algo.group_size=3",
    "agents.timeout_s=120",
    "trainer.lr=1e-3",
]
# "digits" (steps 0 and 2 of the first run) writes no answer: a group of equal rewards every time
EXECUTOR = LongTailExecutor(hour_s=4.0, tool_s=0.4, max_tokens=6, seed=1, unanswered_tasks=("digits",))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    ship_by_value()
    with private_ray():
        folder = tmp_path_factory.mktemp("run")
        rt = toy_runtime(folder, OVERRIDES, EXECUTOR)
        yield rt, folder
        rt.shutdown()


def _run(runtime, steps: int, tag: str, **scheduler) -> dict:
    rt, folder = runtime
    section = {"policy": "elastic", "staleness": 1, **scheduler}
    return ray.get(rt.scheduler.run.remote(steps, scheduler=section, tag=tag), timeout=900)


def _token_versions(folder: Path, exec_id: str) -> list[int]:
    return [v for r in read_jsonl(folder / "records" / f"{exec_id}.jsonl") for v in r.versions]


def test_actors_are_named_in_the_runs_namespace(runtime) -> None:
    rt, _ = runtime
    for name in ("cell-0", "cell-1", "cell-2", "store", "scheduler", "workers"):
        assert ray.get_actor(name, namespace=rt.namespace) is not None
    assert rt.core_id == "cell-0" and ray.get(rt.core.status.remote())["is_core"]
    assert not ray.get(rt.cells["cell-1"].status.remote())["is_core"]


def test_eta1_pipelines_steps_within_the_bound_and_elastic_returns_cells_for_demand(runtime) -> None:
    rt, folder = runtime
    result = _run(runtime, 3, "p1.")
    steps, trace = result["steps"], result["trace"]
    v0 = steps[0]["version"] - 1
    assert [m["version"] for m in steps] == [v0 + 1, v0 + 2, v0 + 3]
    early_with_old_tokens = 0
    for k, metrics in enumerate(steps[:-1]):
        published = metrics["published_at_s"]
        early = [r for r in trace if r["step"] == k + 1 and r["start"] < published]
        for row in early:  # launched before update k: its first tokens come from version v0 + k
            early_with_old_tokens += (v0 + k) in _token_versions(folder, row["exec_id"])
    assert early_with_old_tokens > 0, "some step k+1 executions must generate tokens with version k"
    for k, metrics in enumerate(steps):  # no trained token older than the bound, from the records
        assert metrics["staleness"]["max"] <= 1
        for row in (r for r in trace if r["step"] == k):
            assert min(_token_versions(folder, row["exec_id"])) >= v0 + k - 1
    assert sum(m["overlap_s"] for m in steps) > 0
    assert max(m["staleness"]["max"] for m in steps) == 1
    assert any(m.get("logprob_gap_max", 0) > 1e-3 for m in steps[1:]), "stale tokens: the ratio acts"
    returns = [e for e in result["switches"] if e["direction"] == "train->rollout"]
    assert any(e["demand"] > e["rollout_capacity"] for e in returns), result["switches"]
    assert set(result["costs"]) >= {"makespan_s", "micro_step_s", "switch_to_train_s"}
    assert len(trace) == 18 and all(r["end"] >= r["start"] for r in trace)
    flat_tasks = 0
    for k, metrics in enumerate(steps):  # a task whose rewards are all equal: counted, not trained
        rewards: dict[str, set] = {}
        for row in (r for r in trace if r["step"] == k):
            rewards.setdefault(row["task"], set()).add(row["reward"])
        flat = {task for task, values in rewards.items() if len(values) == 1}
        flat_tasks += len(flat)
        assert metrics["executions_untrained"] == 3 * len(flat)
        assert all(r["trajectories"] == 0 for r in trace if r["step"] == k and r["task"] in flat)
        assert all(r["trajectories"] > 0 for r in trace if r["step"] == k and r["task"] not in flat)
    assert flat_tasks > 0, "the unanswered digits task has equal rewards"


def test_async_never_switches_and_trains_on_its_fixed_cells(runtime) -> None:
    result = _run(runtime, 2, "a1.", policy="async", async_train_cells=1)
    assert result["switches"] == []
    trained = {cell for m in result["steps"] for cell in m["trained_by_cell"]}
    assert trained == {"cell-0"}
    assert result["costs"]["async_train_cells"] == 1
    assert result["utilisation"]["cell-0"]["rollout"] == 0.0


def test_eta0_stays_on_policy(runtime) -> None:
    rt, folder = runtime
    result = _run(runtime, 2, "e0.", staleness=0)
    steps, trace = result["steps"], result["trace"]
    v0 = steps[0]["version"] - 1
    first = steps[0]["published_at_s"]
    assert not [r for r in trace if r["step"] == 1 and r["start"] < first]
    for k in range(2):
        assert steps[k]["staleness"]["max"] == 0
        rows = [r for r in trace if r["step"] == k]
        assert rows, f"step {k} has no execution in the trace"
        for row in rows:
            assert set(_token_versions(folder, row["exec_id"])) == {v0 + k}


def test_an_auto_duration_prior_is_fitted_at_each_steps_end_for_the_sibling_order(runtime) -> None:
    result = _run(runtime, 2, "f1.", elastic_launch_order="sibling", elastic_duration_prior="auto")
    models = [m["duration_model"] for m in result["steps"]]
    assert len(models) == 2
    fitted = [m for m in models if "error" not in m]
    assert fitted, models  # 6 executions of 2 tasks have ended by the first step's end
    last = fitted[-1]
    assert last["sigma_log_hours"] > 0 and 0 < last["rho"] < 1 and last["tasks"] >= 2
    assert last["executions"] >= 6 and len(result["trace"]) == 12
