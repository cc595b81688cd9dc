"""`gyre-ray plan`: sweep cluster size and cell size for a workload and recommend a layout.

A workload's capacity and training cost describe a reference cluster of `reference_nodes` nodes.
A cluster of N nodes scales both by N / reference_nodes (rollout capacity up, training time down);
splitting it into cells of s nodes gives C = N / s cells. Cells smaller than `min_cell_nodes`
(the nodes one full model replica needs for training) are not considered. Every layout runs the
same sampled workload. For each cluster size the recommendation is its fastest layout, preferring
larger cells (fewer gradient transfers) when makespans are within `tie_tolerance`; across
cluster sizes, node-hours tell what the speed costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_ray.sim.engine import SimCosts
from gyre_ray.sim.runner import simulate
from gyre_ray.sim.workload import SampledWorkload, WorkloadSpec, sample_workload


@dataclass(frozen=True)
class Layout:
    """One candidate: `nodes` split into `cells` cells of `cell_nodes` nodes, and how it ran."""

    nodes: int
    cell_nodes: int
    cells: int
    makespan_s: float
    lower_bound_s: float
    utilization: float
    switches: int

    @property
    def node_hours(self) -> float:
        return self.nodes * self.makespan_s / 3600.0


def scale_cluster(spec: WorkloadSpec, factor: float) -> WorkloadSpec:
    """The workload on a cluster `factor` times the reference one (more capacity, faster training)."""
    if factor <= 0:
        raise ValueError(f"cluster scale factor must be > 0, got {factor}")
    return spec.model_copy(
        update={
            "capacity_executions": spec.cluster_capacity * factor,
            "train_cluster_s_per_trajectory": spec.train_cluster_s_per_trajectory / factor,
        }
    )


def candidate_layouts(nodes: int, min_cell_nodes: int, cell_nodes: list[int] | None) -> list[tuple[int, int]]:
    """(cell_nodes, cells) pairs that split `nodes` evenly into cells of at least `min_cell_nodes`."""
    sizes = cell_nodes or [s for s in range(1, nodes + 1) if nodes % s == 0]
    if sizes and min(sizes) < 1:
        raise ValueError(f"cell sizes must be >= 1 node, got {sorted(set(sizes))}")
    bad = [s for s in sizes if nodes % s]
    if bad:
        raise ValueError(f"cell sizes {bad} do not divide {nodes} nodes evenly")
    layouts = [(s, nodes // s) for s in sorted(set(sizes)) if s >= min_cell_nodes and nodes // s >= 2]
    if not layouts:
        raise ValueError(
            f"no layout of {nodes} nodes has >= 2 cells of >= {min_cell_nodes} nodes (min_cell_nodes)"
        )
    return layouts


def plan_layouts(
    spec: WorkloadSpec,
    node_counts: list[int],
    reference_nodes: int,
    min_cell_nodes: int = 1,
    cell_nodes: list[int] | None = None,
    steps: int = 12,
    staleness: int = 1,
    policy: str = "elastic",
    seed: int = 0,
    costs: SimCosts | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: Path | None = None,
    jobs: int = 1,
) -> list[Layout]:
    """Simulate `policy` on every layout of every cluster size; returns them fastest first.

    Every cluster size's layouts are checked (and its workload sampled) before the first simulation.
    `progress`, if given, gets a line after each layout (its makespan per step, ratio to the bound, and
    seconds taken). `base_dir`: the folder a relative `trace` of the spec is read from (the workload
    YAML's, as `load_workload` returns it). `jobs`: processes that simulate elastic's candidates at once."""
    candidates = {nodes: candidate_layouts(nodes, min_cell_nodes, cell_nodes) for nodes in node_counts}
    workloads: dict[int, SampledWorkload] = {}
    for nodes, pairs in candidates.items():
        wl = sample_workload(scale_cluster(spec, nodes / reference_nodes), steps, seed, base_dir)
        _check_capacity(spec, wl, nodes, reference_nodes, max(cells for _, cells in pairs))
        workloads[nodes] = wl
    total = sum(len(c) for c in candidates.values())
    layouts: list[Layout] = []
    began = time.monotonic()
    for nodes, pairs in candidates.items():
        wl = workloads[nodes]
        for size, cells in pairs:
            started = time.monotonic()
            result = simulate(wl, [policy], cells, staleness, costs, jobs=jobs)[policy]
            if progress is not None:
                now = time.monotonic()
                progress(
                    f"{nodes} nodes as {cells} cells of {size} node{'s' if size > 1 else ''}: "
                    f"{result.makespan_s / 3600 / steps:.3f} h per step, "
                    f"{_times_bound(result.makespan_s, result.lower_bound_s)} "
                    f"({len(layouts) + 1}/{total}, {now - started:.1f} s, {now - began:.1f} s in all)"
                )
            layouts.append(
                Layout(
                    nodes,
                    size,
                    cells,
                    result.makespan_s,
                    result.lower_bound_s,
                    result.utilization,
                    result.switches,
                )
            )
    return sorted(layouts, key=lambda x: x.makespan_s)


def _times_bound(makespan_s: float, lower_bound_s: float) -> str:
    """`1.234 x bound`, or `- x bound` where the bound is 0 (a workload with no work)."""
    return f"{makespan_s / lower_bound_s:.3f} x bound" if lower_bound_s > 0 else "- x bound"


def _check_capacity(
    spec: WorkloadSpec, wl: SampledWorkload, nodes: int, reference_nodes: int, cells: int
) -> None:
    """ValueError naming the reference size and the workload's capacity when `nodes` nodes split into
    `cells` cells leave a cell less rollout capacity than one execution needs."""
    biggest = float(wl.demand.max()) if wl.n_executions else 0.0
    per_cell = wl.capacity_per_cell(cells)
    if biggest <= per_cell + 1e-9:
        return
    most = math.floor(spec.cluster_capacity * nodes / (cells * biggest))
    fixes = [f"--reference-nodes <= {most:,}"] if most >= 1 else []
    fixes += ["larger cells (--min-cell-nodes)", "more capacity_executions"]
    raise ValueError(
        f"{nodes} nodes as {cells} cells get {per_cell:.3g} executions of rollout capacity per cell, under one "
        f"execution's demand of {biggest:.3g}: the workload's capacity ({spec.capacity_origin()}) is for "
        f"{reference_nodes:,} reference nodes (--reference-nodes, default the first of --nodes) and scales by "
        f"{nodes:,}/{reference_nodes:,}; give {', '.join(fixes[:-1])} or {fixes[-1]}"
    )


def recommend(layouts: list[Layout], nodes: int, tie_tolerance: float = 0.01) -> Layout:
    """The fastest layout of `nodes` nodes; among those within `tie_tolerance` of it, the largest cells."""
    mine = [x for x in layouts if x.nodes == nodes]
    if not mine:
        raise ValueError(f"no layout with {nodes} nodes was simulated")
    best = min(x.makespan_s for x in mine)
    close = [x for x in mine if x.makespan_s <= best * (1 + tie_tolerance)]
    return min(close, key=lambda x: (-x.cell_nodes, x.makespan_s))
