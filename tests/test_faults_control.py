"""Faults of the run's control actors: the scheduler actor dies mid-step, the record store dies mid-step.

One local Ray and one `Runtime` for the module (two tiny-model dual-role cells, the scheduler actor,
`tests/fault_workload.py`'s counting harness); each test runs one step (its own execution-id tag) and
kills one control actor's process while the step's executions are making calls. Ray restarts the
actor; the test checks that the step completes with 0 executions lost (every one ended valid), 0
records lost (every call a harness got a 200 for is in the store, on disk) and, for the scheduler,
the update equal to the fault-free update of the same micro-batches (<= 1e-6 relative).
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
    wait_for_calls,
)
from local_ray import private_ray, toy_runtime

from gyre_ray.runtime.cluster import Runtime
from gyre_ray.runtime.journal import RunJournal
from gyre_ray.runtime.report import recovery_lines

pytestmark = pytest.mark.slow

OVERRIDES = fault_overrides(cells=2, capacity=4)
EXECUTOR = CountingExecutor(calls=4, max_tokens=16, tool_s=0.4)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    ship_by_value()
    with private_ray():
        folder = tmp_path_factory.mktemp("control")
        rt = toy_runtime(folder, OVERRIDES, EXECUTOR)
        rt.folder = folder
        yield rt
        rt.shutdown()


def check_one_clock(rt: Runtime, result: dict, killed_at: float) -> None:
    """The restarted scheduler went on with the dead one's clock: the trace keeps each execution's
    journaled launch time (it was 0.0 for every execution launched before the restart), the update
    is published after the kill on that clock, and the makespan covers the time before the kill."""
    journal = RunJournal.read(rt.folder)
    assert journal is not None and journal.clock_wall is not None
    launched_at = {facts["execution_id"]: facts["at_s"] for facts in journal.launches.values()}
    assert launched_at and all(
        row["start"] == round(launched_at[row["exec_id"]], 4) for row in result["trace"]
    )
    published_wall = journal.clock_wall + result["steps"][0]["published_at_s"]
    assert killed_at <= published_wall <= time.time(), (killed_at, published_wall)
    first_start = min(row["start"] for row in result["trace"])
    makespan = result["costs"]["makespan_s"]
    assert makespan >= killed_at - (journal.clock_wall + first_start)  # the time before the kill counts
    published_at = result["steps"][0]["published_at_s"]
    assert abs(makespan - (published_at - first_start)) < 1e-3  # first launch to publish


def test_scheduler_actor_dies_mid_step(runtime) -> None:
    rt = runtime
    start = ray.get(rt.core.state_dict.remote(), timeout=60)
    version = ray.get(rt.core.trainer_version.remote(), timeout=30)
    run_ref = rt.scheduler.run.remote(1, scheduler={"policy": "colocate", "staleness": 0}, tag="s-")
    wait_for_calls(rt, run_ref, calls=4)  # about one call per execution: every harness mid-way
    old_pid = ray.get(rt.scheduler.pid.remote(), timeout=30)
    killed_at = time.time()
    ray.kill(rt.scheduler, no_restart=False)
    result = ray.get(run_ref, timeout=600)
    check_one_clock(rt, result, killed_at)
    assert ray.get(rt.scheduler.pid.remote(), timeout=30) != old_pid  # a new process answered
    restarts = result["scheduler_restarts"]
    print("scheduler restarts", restarts)
    assert len(restarts) == 1 and restarts[0]["executions_reattached"] >= 1, restarts
    assert len(result["steps"]) == 1 and result["steps"][0]["executions"] == 4
    check_nothing_lost(rt.folder, result, executions=4, calls=EXECUTOR.calls)
    batches = ray.get(rt.scheduler.micro_batches.remote(0), timeout=60)
    final = ray.get(rt.core.state_dict.remote(), timeout=60)
    gap = relative_update_gap(start, final, reference_weights(rt, start, version, batches))
    print(f"update gap {gap:.3g} over {len(batches)} micro-batches")
    assert gap <= 1e-6, gap


def test_store_actor_dies_mid_step(runtime) -> None:
    rt = runtime
    before = ray.get(rt.store.stats.remote(), timeout=30)["records"]
    run_ref = rt.scheduler.run.remote(1, scheduler={"policy": "colocate", "staleness": 0}, tag="r-")
    wait_for_calls(rt, run_ref, calls=before + 5)
    ray.kill(rt.store, no_restart=False)  # its process dies; Ray starts it again, it replays its files
    result = ray.get(run_ref, timeout=600)
    check_nothing_lost(rt.folder, result, executions=4, calls=EXECUTOR.calls)
    stats = ray.get(rt.store.stats.remote(), timeout=30)
    print("store after the restart", stats)
    assert stats["records"] == before + 4 * EXECUTOR.calls  # every record, none twice
    assert not result["scheduler_restarts"] and len(result["steps"]) == 1


def test_workers_actor_dies_mid_step(runtime) -> None:
    """`workers` (every execution's executor without `agents.runners`) is killed mid-step: Ray starts it
    again and the scheduler starts each execution it held again there, from the beginning, under a
    new id (`r1.<id>`); the step trains on every execution's full records."""
    rt = runtime
    before = ray.get(rt.store.stats.remote(), timeout=30)["records"]
    run_ref = rt.scheduler.run.remote(1, scheduler={"policy": "colocate", "staleness": 0}, tag="w-")
    wait_for_calls(rt, run_ref, calls=before + 2)  # no harness is done yet: each makes 4 calls
    ray.kill(rt.workers, no_restart=False)
    result = ray.get(run_ref, timeout=600)
    losses = result["runner_losses"]
    print("workers losses", losses)
    assert len(losses) == 4, losses
    # each waited for Ray to start `workers` again rather than block the scheduler loop
    assert all(loss["actor"] == "workers" and loss["runner"] is None for loss in losses), losses
    assert all(loss["on_runner"] == "waiting" for loss in losses), losses
    assert all(loss["relaunched_as"] == "r1." + loss["execution"] for loss in losses), losses
    check_nothing_lost(rt.folder, result, executions=4, calls=EXECUTOR.calls)
    assert {row["runner"] for row in result["trace"]} == {"workers"}
    assert "4 execution(s) started again after their executor died (workers x4)" in recovery_lines(result)
    assert {row["exec_id"] for row in result["trace"]} == {loss["relaunched_as"] for loss in losses}
    assert len(result["steps"]) == 1 and result["steps"][0]["executions"] == 4


def test_an_evaluation_round_survives_its_executor(runtime) -> None:
    """An evaluation round's executions whose `workers` dies under them start again (`r1.<id>`,
    a fresh workspace with the same seed) and the round's row scores every one. Once the row is
    written, every execution of the round, lost or not, is finished (through the proxy: records on
    file, key revoked)."""
    from gyre_ray.evaluation import EvalRunner

    rt = runtime
    cfg = rt.config.model_copy(update={"run": rt.config.run.model_copy(update={"eval_every": 1})})
    slow = CountingExecutor(calls=6, max_tokens=16, tool_s=0.5)  # >= 3 s: still running at the kill
    evaluator = EvalRunner(
        cfg, rt.store, [rt.workers], rt.proxy.base_url, rt.folder / "eval", slow, proxy=rt.proxy_admin()
    )
    assert evaluator.start(0, 0)
    ids = [item.execution_id for item in evaluator.rounds[0].items]
    names = [item.workspace.name for item in evaluator.rounds[0].items]
    deadline = time.monotonic() + 300
    while True:  # until one has a record, so every harness is mid-way
        done = ray.get([rt.store.execution_info.remote(i) for i in ids], timeout=30)
        if any(info["num_records"] for info in done):
            break
        assert time.monotonic() < deadline, "the evaluation made no calls"
        time.sleep(0.05)
    assert all(info["num_records"] < slow.calls for info in done), done
    ray.kill(rt.workers, no_restart=False)
    (row,) = evaluator.finish(0, timeout_s=600)
    assert row["executions"] == row["valid"] == len(ids) == len(evaluator.tasks) * cfg.run.eval_samples, row
    started_again = sorted(p.name for p in (rt.folder / "eval" / "workspaces" / "eval-0").glob("r1.*"))
    assert started_again == sorted("r1." + name for name in names)  # every one: all were mid-way
    every = ids + ["r1." + i for i in ids]
    infos = ray.get([rt.store.execution_info.remote(i) for i in every], timeout=30)
    assert all(info["finished"] for info in infos), infos


def test_a_group_whose_processing_dies_with_workers_is_processed_again(runtime) -> None:
    """A group job on `workers` that fails because the actor died waits (and the loss is journaled as
    a fault), not raised nor blocking the loop; it is submitted again once `workers` answers a probe:
    its records are in the store."""
    rt = runtime
    from types import SimpleNamespace

    from gyre_ray.runtime.scheduler import RunScheduler
    from gyre_ray.runtime.work import GroupJob

    @ray.remote
    class Doomed:
        def wait(self) -> None:
            time.sleep(60)

    doomed = Doomed.remote()
    ref = doomed.wait.remote()
    ray.kill(doomed)
    submitted, journaled = [], []
    fake = SimpleNamespace(
        faults=[], _now=lambda: 1.0, journal=SimpleNamespace(fault=journaled.append), workers=rt.workers,
        _submit_group=submitted.append, _group_done=lambda *_: pytest.fail("no result came back"),
        lost_runners=set(), waiting_groups=[], runner_probe_due={}, lost_at={}, _start_waiting=lambda: None,
    )  # fmt: skip
    job = GroupJob("s0-vowels", 0, 0.5)
    RunScheduler._group_processed(fake, ref, job)
    assert submitted == [] and fake.waiting_groups == [job] and fake.lost_runners == {None}
    assert journaled == fake.faults and fake.faults[0]["group_processed_again"] == "s0-vowels"
    for probe, answers in ((doomed.wait.remote(), False), (rt.workers.node_ip.remote(), True)):
        ray.wait([probe], timeout=60)  # as the loop does: a probe is read once it is ready
        RunScheduler._runner_probed(fake, probe, None)
        if not answers:  # the dead actor fails it: asked again later
            assert submitted == [] and fake.lost_runners == {None} and None in fake.runner_probe_due
    assert submitted == [job] and fake.waiting_groups == [] and fake.lost_runners == set()
