"""A private local Ray for a test module: `with private_ray(): ...` in a module-scoped fixture; or
several Ray nodes on this machine (`with local_cluster(...) as (nodes, added): ...`).

Jobs (`gyre_ray.train.train`) and runtimes started inside it reuse it instead of starting and
stopping a Ray and a Serve of their own, which is most of a small job's set-up time on 2 cores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gyre_ray.runtime.cluster import start_local_ray


@contextlib.contextmanager
def private_ray(**options: Any) -> Iterator[None]:
    """`ray.init(address="local")` with 2 logical CPUs and no dashboard; Serve and Ray stop at the end."""
    import ray

    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING", **options)
    try:
        yield
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def toy_runtime(folder: Path, overrides: list[str], executor: Any, timeout_s: float = 300.0) -> Any:
    """A `Runtime` of jobs/configs/toy.yaml with `overrides`, its records under `folder/records` and its
    scheduler's run folder `folder`, executions run by `executor` (a test workload); in a Ray that is up."""
    from gyre_ray.config import load_config
    from gyre_ray.runtime.cluster import Runtime

    cfg = load_config("jobs/configs/toy.yaml", [*overrides, f"proxy.records_dir={folder / 'records'}"])
    return Runtime.start(
        cfg, scheduler_options={"run_dir": str(folder), "execute": executor}, timeout_s=timeout_s
    )


NODE_MEMORY = {"object_store_memory": 100 * 1024 * 1024}


@contextlib.contextmanager
def local_cluster(head: dict[str, Any], nodes: list[dict[str, Any]]) -> Iterator[tuple[Any, list[Any]]]:
    """A head with `head`'s `ray start` options and one node per item of `nodes` (`ray.cluster_utils`),
    joined by this process; Serve, Ray and every node stop at the end."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={**NODE_MEMORY, "include_dashboard": False, **head}
    )
    added = [cluster.add_node(**NODE_MEMORY, **options) for options in nodes]
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster, added
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def actor_nodes() -> dict[str, str]:
    """Live named actors -> the node they run on (from the GCS actor table)."""
    import ray

    table = ray._private.state.actors()
    return {a["Name"]: a["Address"]["NodeID"] for a in table.values() if a["Name"] and a["State"] == "ALIVE"}
