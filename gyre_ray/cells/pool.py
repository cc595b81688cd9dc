"""Start rollout cells on Ray: one placement group per cell, one `RolloutCell` actor inside it.

`plan_cells` is the pure part (names and bundles, testable without Ray); `CellPool.start` reserves
the placement groups, starts the actors (named, so a Serve replica can look them up), waits for
their engines and returns the pool; `shutdown` kills the actors and frees the groups.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from gyre_ray.cells.cell import EngineFactory, RolloutCell
from gyre_ray.cells.dual_role import DualRoleCell, TrainerFactory


@dataclass
class CellSpec:
    cell_id: str
    actor_name: str
    bundles: list[dict[str, float]]
    torch_threads: int


def plan_cells(
    num_cells: int, cpus_per_cell: float, prefix: str = "cell", gpus_per_cell: float = 0.0
) -> list[CellSpec]:
    """One single-bundle placement group per cell ({"CPU": c} plus {"GPU": g} when g > 0); torch
    threads = whole CPUs of the bundle (>= 1). Actor names are `<prefix>-<i>`."""
    if num_cells < 1:
        raise ValueError(f"num_cells must be >= 1, got {num_cells}")
    if not cpus_per_cell > 0:
        raise ValueError(f"cpus_per_cell must be > 0, got {cpus_per_cell}")
    if gpus_per_cell < 0:
        raise ValueError(f"gpus_per_cell must be >= 0, got {gpus_per_cell}")
    threads = max(1, math.floor(cpus_per_cell))
    bundle = {"CPU": float(cpus_per_cell)}
    if gpus_per_cell > 0:
        bundle["GPU"] = float(gpus_per_cell)
    return [CellSpec(f"cell-{i}", f"{prefix}-{i}", [dict(bundle)], threads) for i in range(num_cells)]


@dataclass
class CellPool:
    """Running cells: id -> actor handle, plus their placement groups."""

    specs: list[CellSpec]
    actors: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    namespace: str | None = None

    @property
    def cell_ids(self) -> list[str]:
        return [spec.cell_id for spec in self.specs]

    @property
    def actor_names(self) -> dict[str, str]:
        return {spec.cell_id: spec.actor_name for spec in self.specs}

    @classmethod
    def start(
        cls,
        num_cells: int,
        engine_factory: EngineFactory,
        cpus_per_cell: float = 1.0,
        prefix: str = "cell",
        timeout_s: float = 300.0,
        namespace: str | None = None,
        detached: bool = False,
        stream_interval_s: float = 0.0,
        trainer_factory: TrainerFactory | None = None,
        gpus_per_cell: float = 0.0,
        core_index: int = 0,
        transfer: dict[str, Any] | None = None,
    ) -> CellPool:
        """Reserve the groups, start one cell actor in each and wait until every engine is built.

        `detached`: groups and actors outlive the calling process (Serve app builders).
        `stream_interval_s`: see `RolloutCell`.
        `trainer_factory`: start `DualRoleCell`s (rollout or training; cell `core_index` is the core).
        `transfer`: rollout cells' `transfer` section (dumped; dual-role cells take the trainer factory's).
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pool = cls(plan_cells(num_cells, cpus_per_cell, prefix, gpus_per_cell), namespace=namespace)
        actor_cls = ray.remote(RolloutCell if trainer_factory is None else DualRoleCell)
        try:
            for spec in pool.specs:
                group = placement_group(
                    spec.bundles,
                    strategy="PACK",
                    name=f"{namespace or 'gyre'}-{spec.actor_name}-pg",
                    lifetime="detached" if detached else None,
                )
                pool.groups[spec.cell_id] = group
            ray.get([g.ready() for g in pool.groups.values()], timeout=timeout_s)
            for index, spec in enumerate(pool.specs):
                args = (spec.cell_id, engine_factory, spec.torch_threads, stream_interval_s, transfer)
                if trainer_factory is not None:
                    args = (
                        spec.cell_id,
                        engine_factory,
                        trainer_factory,
                        spec.torch_threads,
                        index == core_index,
                        stream_interval_s,
                    )
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pool.groups[spec.cell_id], placement_group_bundle_index=0
                )
                pool.actors[spec.cell_id] = actor_cls.options(
                    name=spec.actor_name,
                    namespace=namespace,
                    num_cpus=spec.bundles[0]["CPU"],
                    num_gpus=spec.bundles[0].get("GPU", 0.0),
                    scheduling_strategy=strategy,
                    max_concurrency=1000,
                    lifetime="detached" if detached else None,
                ).remote(*args)
            ray.get([a.setup.remote() for a in pool.actors.values()], timeout=timeout_s)
        except BaseException:
            pool.shutdown()
            raise
        return pool

    def status(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.status.remote() for a in self.actors.values()], timeout=timeout_s)

    def shutdown(self) -> None:
        """Kill the cell actors and remove their placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        for group in self.groups.values():
            with contextlib.suppress(Exception):  # already gone with the cluster
                remove_placement_group(group)
        self.actors.clear()
        self.groups.clear()
