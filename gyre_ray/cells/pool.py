"""Start rollout cells on Ray: one placement group with one bundle per cell, one cell actor in each bundle.

`plan_cells` is the pure part (names and bundles, testable without Ray); `CellPool.start` reserves
the placement group (its strategy, e.g. SPREAD, says how the cells spread over nodes), starts the
actors (named, so a Serve replica can look them up), waits for their engines and returns the pool;
`restart` replaces a dead cell's actor in its bundle; `shutdown` kills the actors and frees the group.
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
    """Running cells: id -> actor handle, plus the one placement group they live in (bundle i = cell i).

    `recipe` is what a cell's actor is built from (factories and options), so `restart` can start a
    new actor for a cell that died, in the same bundle, under the same name.
    """

    specs: list[CellSpec]
    actors: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    namespace: str | None = None
    recipe: dict[str, Any] = field(default_factory=dict)

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
        strategy: str = "PACK",
        transfer: dict[str, Any] | None = None,
    ) -> CellPool:
        """Reserve the placement group, start one cell actor per bundle and wait until every engine is built.

        `detached`: group and actors outlive the calling process (Serve app builders).
        `stream_interval_s`: see `RolloutCell`.
        `trainer_factory`: start `DualRoleCell`s (rollout or training; cell `core_index` is the core).
        `strategy`: the group's placement strategy over nodes (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD).
        `transfer`: rollout cells' `transfer` section (dumped; dual-role cells take the trainer factory's).
        """
        import ray
        from ray.util.placement_group import placement_group

        pool = cls(plan_cells(num_cells, cpus_per_cell, prefix, gpus_per_cell), namespace=namespace)
        pool.recipe = {
            "engine_factory": engine_factory,
            "trainer_factory": trainer_factory,
            "stream_interval_s": stream_interval_s,
            "core_index": core_index,
            "detached": detached,
            "transfer": transfer,
        }
        try:
            group = placement_group(
                [spec.bundles[0] for spec in pool.specs],
                strategy=strategy,
                name=f"{namespace or 'gyre'}-{prefix}-pg",
                lifetime="detached" if detached else None,
            )
            for spec in pool.specs:
                pool.groups[spec.cell_id] = group
            ray.get(group.ready(), timeout=timeout_s)
            for index, spec in enumerate(pool.specs):
                pool.actors[spec.cell_id] = pool._new_actor(index)
            ray.get([a.setup.remote() for a in pool.actors.values()], timeout=timeout_s)
        except BaseException:
            pool.shutdown()
            raise
        return pool

    def _new_actor(self, index: int, draining: bool = False, detached: bool = False) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec, recipe = self.specs[index], self.recipe
        trainer_factory = recipe["trainer_factory"]
        actor_cls = ray.remote(RolloutCell if trainer_factory is None else DualRoleCell)
        engine_factory, interval = recipe["engine_factory"], recipe["stream_interval_s"]
        args: tuple[Any, ...] = (
            spec.cell_id,
            engine_factory,
            spec.torch_threads,
            interval,
            recipe["transfer"],
        )
        extra: dict[str, Any] = {}
        if trainer_factory is not None:
            is_core = index == recipe["core_index"]
            args = (spec.cell_id, engine_factory, trainer_factory, spec.torch_threads, is_core, interval)
            extra = {"peers": [s.actor_name for s in self.specs], "namespace": self.namespace}
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[spec.cell_id], placement_group_bundle_index=index
        )
        return actor_cls.options(
            name=spec.actor_name,
            namespace=self.namespace,
            num_cpus=spec.bundles[0]["CPU"],
            num_gpus=spec.bundles[0].get("GPU", 0.0),
            scheduling_strategy=strategy,
            max_concurrency=1000,
            lifetime="detached" if recipe["detached"] or detached else None,
        ).remote(*args, draining=draining, **extra)

    def restart(self, cell_id: str) -> Any:
        """A new actor for a cell whose actor died: same name, same bundle, started *drained*.

        The old actor is killed first (it may only be unreachable). Its engine and trainer are not
        built yet: the caller runs `rejoin` (a dual-role cell) or `setup`, then undrains it. The
        actor starts once its bundle is placed again (Ray re-places the bundles of a lost node
        where resources allow; until then the call waits).
        """
        import ray

        index = self.cell_ids.index(cell_id)
        old = self.actors.get(cell_id)
        if old is not None:
            with contextlib.suppress(Exception):
                ray.kill(old, no_restart=True)
        # detached: the restarted cell does not die with its creator (the scheduler actor, which may
        # itself be restarted); `shutdown` kills it by name
        self.actors[cell_id] = actor = self._new_actor(index, draining=True, detached=True)
        return actor

    def status(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.status.remote() for a in self.actors.values()], timeout=timeout_s)

    def shutdown(self) -> None:
        """Kill the cell actors (also ones restarted elsewhere, found by name) and remove the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for spec in self.specs:
            actors = [self.actors.get(spec.cell_id)]
            with contextlib.suppress(Exception):  # a restarted actor this handle does not know
                actors.append(ray.get_actor(spec.actor_name, namespace=self.namespace))
            for actor in actors:
                if actor is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
        for group in {id(g): g for g in self.groups.values()}.values():
            with contextlib.suppress(Exception):  # already gone with the cluster
                remove_placement_group(group)
        self.actors.clear()
        self.groups.clear()
