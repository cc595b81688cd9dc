"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`): cells spread over nodes, one is lost mid-step.

A head (1 CPU) and two worker nodes (1 CPU each, custom resources `gyre_node_a` / `gyre_node_b` so the
nodes are told apart); three tiny-model cells of 0.5 CPU with `cells.strategy=SPREAD`. The store,
the scheduler, the workers actor and the proxy replica run on the head (`cells.control_on_head`).
The node of a non-core cell is removed while the step's executions run: the step still trains,
with no execution or record lost, and the lost cell is re-placed on a surviving node and rejoins.
"""

from __future__ import annotations

import time

import pytest
import ray
from fault_workload import CountingExecutor, check_nothing_lost, ship_by_value
from local_ray import actor_nodes, local_cluster

from gyre_ray.config import load_config
from gyre_ray.runtime.cluster import Runtime

pytestmark = pytest.mark.slow

OVERRIDES = [
    "cells.num_cells=3",
    "cells.cpus_per_cell=0.5",
    "cells.strategy=SPREAD",
    "cells.capacity=2",
    "proxy.port=0",
    "proxy.queue_timeout_s=5",
    "run.tasks_per_step=2",
    "algo.group_size=2",
    "agents.timeout_s=300",
    "trajectory.row_tokens=64",
    "trajectory.micro_batch_tokens=64",
]


@pytest.fixture(scope="module")
def cluster():
    ship_by_value()
    nodes = [{"num_cpus": 1, "resources": {f"gyre_node_{x}": 1}} for x in "ab"]
    with local_cluster({"num_cpus": 1}, nodes) as started:
        yield started


def wait_alive(names: tuple[str, ...], timeout_s: float = 120.0) -> dict[str, str]:
    """`actor_nodes()` once every actor in `names` is alive (a loaded machine starts them late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = actor_nodes()
        if all(name in running for name in names) or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def cell_nodes(rt: Runtime) -> dict[str, str]:
    from ray.util import placement_group_table

    group = placement_group_table(rt.pool.groups["cell-0"])
    return {cell: group["bundles_to_node_id"][i] for i, cell in enumerate(rt.pool.cell_ids)}


def test_cells_spread_over_nodes_and_a_lost_node_is_survived(cluster, tmp_path) -> None:
    nodes, workers = cluster
    head = nodes.head_node.node_id
    cfg = load_config("jobs/configs/toy.yaml", [*OVERRIDES, f"proxy.records_dir={tmp_path / 'records'}"])
    executor = CountingExecutor(calls=4, max_tokens=16, tool_s=0.4)
    rt = Runtime.start(cfg, scheduler_options={"run_dir": str(tmp_path), "execute": executor}, timeout_s=600)
    try:
        placed = cell_nodes(rt)
        assert len(set(placed.values())) == 3, placed  # SPREAD: one cell per node
        ray.get([rt.scheduler.progress.remote(), rt.store.stats.remote()], timeout=300)  # both are up
        running = wait_alive(("scheduler", "store", "workers"))
        for name in ("scheduler", "store", "workers"):
            assert running[name] == head, (name, running)
        replicas = [n for n in running if n.startswith("SERVE_REPLICA::gyre-proxy")]
        assert replicas and all(running[n] == head for n in replicas)

        run_ref = rt.scheduler.run.remote(1, scheduler={"policy": "elastic", "staleness": 0})
        deadline = time.monotonic() + 300
        while ray.get(rt.scheduler.progress.remote(), timeout=60).get("running", 0) < 2:
            assert time.monotonic() < deadline and not ray.wait([run_ref], timeout=0)[0]
            time.sleep(0.05)
        by_id = {w.node_id: w for w in workers}
        victim_cell = next(c for c, n in placed.items() if n in by_id and n != placed["cell-0"])
        victim = placed[victim_cell]
        nodes.remove_node(by_id[victim])
        result = ray.get(run_ref, timeout=900)

        assert len(result["steps"]) == 1 and result["steps"][0]["version"] >= 1
        check_nothing_lost(tmp_path, result, executions=4, calls=executor.calls)
        faults = result["faults"]
        assert [f["cell"] for f in faults] == [victim_cell], faults
        assert faults[0]["restarted"] and "rejoined_at_s" in faults[0], faults
        moved = cell_nodes(rt)[victim_cell]
        assert moved != victim and moved in {head, *(w.node_id for w in workers)}
        status = ray.get(ray.get_actor(victim_cell, namespace=rt.namespace).status.remote(), timeout=60)
        assert not status["draining"] and status["engine"]["version"] == result["steps"][0]["version"]
        print("faults", faults, "cells", cell_nodes(rt))
    finally:
        rt.shutdown()
