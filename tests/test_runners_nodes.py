"""Executions on agent nodes of their own (`agents.runners`), on several Ray nodes of this machine.

A head (the cells, the store, the scheduler, `workers` and the proxy) and two agent nodes that offer
the custom resource `agents`; `agents.runners=2` with `agents.runner_resources={agents: 1}` puts one
runner actor on each agent node, and the step's executions are dealt out over both: every execution
runs on an agent node, none on the head, none lost; a scheduler actor killed mid-step collects each
execution's outcome from its runner; a runner killed mid-step has its executions started again on
the other. Runners that no node can take are refused by name.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from fault_workload import (
    CountingExecutor,
    check_nothing_lost,
    fault_overrides,
    ship_by_value,
    wait_for_calls,
)
from local_ray import actor_nodes, local_cluster

from gyre_ray.config import ConfigError, load_config
from gyre_ray.runtime.cluster import Runtime
from gyre_ray.runtime.journal import RunJournal

pytestmark = pytest.mark.slow

OVERRIDES = [*fault_overrides(cells=2, capacity=2), "agents.runners=2", "agents.runner_resources={agents: 1}"]
EXECUTOR = CountingExecutor(calls=4, max_tokens=12, tool_s=0.4)


@pytest.fixture(scope="module")
def cluster():
    ship_by_value()
    with local_cluster({"num_cpus": 2}, [{"num_cpus": 1, "resources": {"agents": 1}}] * 2) as started:
        yield started


def test_runners_no_node_can_take_are_refused_by_name(cluster, tmp_path) -> None:
    """(First: before the module's runtime holds the proxy's route.)"""
    cfg = load_config(
        "jobs/configs/toy.yaml",
        [*OVERRIDES, "agents.runner_resources={gpu_agents: 1}", f"run.run_dir={tmp_path}"],
    )
    started = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"2 of agents.runners=2 runner actors could not be placed within 20 s: no node offered \{'gpu_agents': 1.0\}",
    ):
        Runtime.start(cfg, scheduler_options={"run_dir": str(tmp_path)}, timeout_s=20)
    assert time.monotonic() - started < 300
    assert not any(name.startswith("runner-") for name in actor_nodes())  # nothing left pending


@pytest.fixture(scope="module")
def runtime(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("runners")
    local = tmp_path_factory.mktemp("node-local")  # each agent node's own disk (one machine here)
    cfg = load_config(
        "jobs/configs/toy.yaml",
        [*OVERRIDES, f"proxy.records_dir={folder / 'records'}", f"agents.workspace_root={local}"],
    )
    rt = Runtime.start(cfg, scheduler_options={"run_dir": str(folder), "execute": EXECUTOR}, timeout_s=600)
    rt.folder = folder
    yield rt
    rt.shutdown()


def test_executions_run_on_the_agent_nodes_dealt_out_over_the_runners(cluster, runtime) -> None:
    nodes, agents = cluster
    placed = actor_nodes()
    assert {placed["runner-0"], placed["runner-1"]} == {a.node_id for a in agents}, (
        placed
    )  # one per agent node
    assert placed["workers"] == nodes.head_node.node_id
    run = runtime.scheduler.run.remote(1, scheduler={"policy": "elastic", "staleness": 0}, tag="a-")
    result = ray.get(run, timeout=900)
    check_nothing_lost(runtime.folder, result, executions=4, calls=EXECUTOR.calls)
    journal = RunJournal.read(runtime.folder)
    assert journal is not None and sorted(journal.runners.values()) == [0, 0, 1, 1], journal.runners
    assert sorted(row["runner"] for row in result["trace"]) == [
        "runner-0",
        "runner-0",
        "runner-1",
        "runner-1",
    ]
    # the workspaces are on the agent nodes' own disk (agents.workspace_root), not in the run folder
    workspaces = runtime.config.agents.workspaces_dir(runtime.folder)
    assert workspaces.parent.parent == Path(runtime.config.agents.workspace_root)
    assert {row["exec_id"] for row in result["trace"]} <= {p.name for p in workspaces.iterdir()}
    assert not (runtime.folder / "workspaces").exists()


def test_a_restarted_scheduler_collects_outcomes_from_each_executions_runner(runtime) -> None:
    """The journal names each execution's runner: the new scheduler asks that one for the outcome (the
    others never ran it and would answer None, which reads as never started: a second launch)."""
    run_ref = runtime.scheduler.run.remote(1, scheduler={"policy": "colocate", "staleness": 0}, tag="b-")
    before = ray.get(runtime.store.stats.remote(), timeout=30)["records"]
    wait_for_calls(runtime, run_ref, calls=before + 4)
    ray.kill(runtime.scheduler, no_restart=False)
    result = ray.get(run_ref, timeout=900)
    restarts = result["scheduler_restarts"]
    assert len(restarts) == 1 and restarts[0]["executions_reattached"] >= 1, restarts
    assert restarts[0]["executions_relaunched"] == 0, restarts
    check_nothing_lost(runtime.folder, result, executions=4, calls=EXECUTOR.calls)


def test_executions_of_a_runner_that_dies_start_again_on_another(runtime) -> None:
    """runner-1's process is killed mid-step: its executions start again from the beginning on
    runner-0 under new ids (`r1.<id>`); the step trains on every execution's full records, and the
    lost harnesses' partial records stay in the store under their old ids."""
    run_ref = runtime.scheduler.run.remote(1, scheduler={"policy": "colocate", "staleness": 0}, tag="c-")
    before = ray.get(runtime.store.stats.remote(), timeout=30)["records"]
    wait_for_calls(runtime, run_ref, calls=before + 2)  # every harness still mid-way
    ray.kill(ray.get_actor("runner-1", namespace=runtime.namespace), no_restart=False)
    result = ray.get(run_ref, timeout=900)
    losses = result["runner_losses"]
    print("runner losses", losses)
    assert losses and all(loss["runner"] == 1 and loss["on_runner"] == 0 for loss in losses), losses
    assert all(loss["relaunched_as"] == "r1." + loss["execution"] for loss in losses), losses
    check_nothing_lost(runtime.folder, result, executions=4, calls=EXECUTOR.calls)
    traced = {row["exec_id"] for row in result["trace"]}
    assert {loss["relaunched_as"] for loss in losses} <= traced
    assert not {loss["execution"] for loss in losses} & traced
    assert len(result["steps"]) == 1 and result["steps"][0]["executions"] == 4


def test_an_evaluation_round_runs_on_the_runners(runtime) -> None:
    """`run.eval_every` and `gyre-ray eval` deal a round's executions out over the runners too; a
    runner Ray is restarting as the round starts is waited for (it used to fail the round)."""
    from gyre_ray.evaluation import EvalRunner

    cfg = runtime.config.model_copy(update={"run": runtime.config.run.model_copy(update={"eval_every": 1})})
    ray.kill(ray.get_actor("runner-1", namespace=runtime.namespace), no_restart=False)
    executors, base_url = runtime.agent_executors()
    assert executors == runtime.runners and len(executors) == 2
    evaluator = EvalRunner(cfg, runtime.store, executors, base_url, runtime.folder / "eval", EXECUTOR)
    assert evaluator.start(0, 0)
    (row,) = evaluator.finish(0, timeout_s=600)
    assert row["executions"] == len(evaluator.tasks) * cfg.run.eval_samples >= 2
    assert row["valid"] == row["executions"], row
    rounds = Path(cfg.agents.workspace_root) / "eval" / "workspaces" / "eval-0"  # on the nodes' own disk
    assert len(list(rounds.iterdir())) == row["executions"]
