"""Where a simulated run's cell time went, phase by phase: the profile behind "x% above the bound".

A phase is the time between two updates (phase k ends with update k; phase 0 starts the run). Each
cell-second of a phase is one of: rolling out (the rollout role's load over its capacity; an execution
paused by a migration or a weight sync holds its slot meanwhile), empty
rollout room (the rest of the rollout role), training (inside a micro-step), other training-role
time (waiting for trainable data, gradient sync, optimizer step, weight publish) or switching. They
add up to cells x phase length (`PhaseProfile.total_s`). `waste_profile` needs a run simulated with
`record=True` (the per-cell load curves). The lower bound grants `granted_s` cell-seconds of non-work
(`bound_grant_s`); the rest of the run's non-work is what a policy could still win, at best.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gyre_ray.sim.bound import step_costs
from gyre_ray.sim.timeline import SimResult
from gyre_ray.sim.workload import SampledWorkload

KINDS = ("rollout_busy_s", "rollout_empty_s", "train_busy_s", "train_other_s", "switching_s")


@dataclass(frozen=True)
class PhaseProfile:
    """Cell-seconds of one phase by kind (module docstring)."""

    phase: int
    start_s: float
    end_s: float
    rollout_busy_s: float
    rollout_empty_s: float
    train_busy_s: float
    train_other_s: float
    switching_s: float

    @property
    def total_s(self) -> float:
        return sum(getattr(self, kind) for kind in KINDS)

    @property
    def non_work_s(self) -> float:
        return self.rollout_empty_s + self.train_other_s + self.switching_s


def waste_profile(result: SimResult, wl: SampledWorkload) -> list[PhaseProfile]:
    """Per-phase cell time of a run simulated with `record=True` (ValueError otherwise).

    Each cell's time is cut at every role change, load change and update; each piece has one role,
    one load and one phase, so a pass over the pieces sums everything (micro-steps are then moved
    from other training-role time to training)."""
    tl = result.timeline
    if not tl.record:
        raise ValueError("waste_profile needs a run simulated with record=True (the cells' load curves)")
    end = result.makespan_s
    capacity = wl.capacity_per_cell(result.n_cells)
    bounds = np.array([0.0, *(t for t in result.update_times if t < end), end])
    sums = np.zeros((bounds.size - 1, len(KINDS)))
    for cell in range(result.n_cells):
        starts = np.array([s for s, _, _ in tl.segments[cell]])
        kinds = [kind for _, _, kind in tl.segments[cell]]
        load_t, load_v = (np.array(x) for x in zip(*tl.loads[cell], strict=True))
        cuts = np.unique(np.concatenate([starts, load_t, bounds]))
        cuts = cuts[(cuts >= 0) & (cuts <= end)]
        t0, span = cuts[:-1], np.diff(cuts)
        phase = np.searchsorted(bounds, t0, side="right") - 1
        segment = np.searchsorted(starts, t0, side="right") - 1
        load = load_v[np.searchsorted(load_t, t0, side="right") - 1]
        rollout = np.array([kinds[i] == "rollout" for i in segment])
        train = np.array([kinds[i] == "train" for i in segment])
        busy = np.where(rollout, span * load / capacity, 0.0)
        np.add.at(sums[:, 0], phase, busy)
        np.add.at(sums[:, 1], phase, np.where(rollout, span, 0.0) - busy)
        np.add.at(sums[:, 3], phase, np.where(train, span, 0.0))
        np.add.at(sums[:, 4], phase, np.where(rollout | train, 0.0, span))
    for _, start, stop, _, _ in tl.micros:  # a micro-step may cross an update: split it at the bounds
        first, last = np.searchsorted(bounds, [start, stop], side="right") - 1
        for p in range(first, min(last, bounds.size - 2) + 1):
            span = min(stop, bounds[p + 1]) - max(start, bounds[p])
            sums[p, 2] += span
            sums[p, 3] -= span
    return [
        PhaseProfile(p, float(bounds[p]), float(bounds[p + 1]), *(float(x) for x in sums[p]))
        for p in range(bounds.size - 1)
    ]


def bound_grant_s(result: SimResult, wl: SampledWorkload, optimizer_step_s: float) -> float:
    """Cell-seconds of non-work the lower bound allows: cells x (bound - last optimizer step) less the
    run's rollout occupancy and training work (the bound's start-up or rollout-role term)."""
    n_cells = result.n_cells
    rollout = float(np.sum(wl.duration_s * wl.demand)) / wl.capacity_per_cell(n_cells)
    per_batch = wl.train_cell_s_per_batch(n_cells)
    work = float(np.sum(per_batch))
    last_step_s = float(step_costs(per_batch, optimizer_step_s)[-1]) if wl.steps else 0.0
    return max(0.0, n_cells * (result.lower_bound_s - last_step_s) - rollout - work)


def profile_summary(result: SimResult, wl: SampledWorkload, optimizer_step_s: float) -> dict[str, Any]:
    """The profile as one JSON object: per phase, the totals, what the bound grants, and the ratio."""
    phases = waste_profile(result, wl)
    totals = {kind: round(sum(getattr(p, kind) for p in phases), 1) for kind in KINDS}
    non_work = sum(p.non_work_s for p in phases)
    granted = bound_grant_s(result, wl, optimizer_step_s)
    parts = {"first": phases[:1], "middle": phases[1:-1], "last": phases[-1:]}
    return {
        "cells": result.n_cells,
        "makespan_s": round(result.makespan_s, 1),
        "lower_bound_s": round(result.lower_bound_s, 1),
        "ratio_to_bound": round(result.makespan_s / result.lower_bound_s, 4),
        "totals_cell_s": totals,
        "non_work_cell_s": round(non_work, 1),
        "bound_grants_cell_s": round(granted, 1),
        # before update 0; between it and the second-to-last update; after that
        "non_work_cell_s_by_part": {k: round(sum(p.non_work_s for p in v), 1) for k, v in parts.items()},
        "phases": [
            {**{k: round(v, 1) for k, v in asdict(p).items() if k != "phase"}, "phase": p.phase}
            for p in phases
        ],
    }
