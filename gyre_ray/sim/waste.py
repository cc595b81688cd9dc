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


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def waste_profile(result: SimResult, wl: SampledWorkload) -> list[PhaseProfile]:
    """Per-phase cell time of a run simulated with `record=True` (ValueError otherwise)."""
    tl = result.timeline
    if not tl.record:
        raise ValueError("waste_profile needs a run simulated with record=True (the cells' load curves)")
    n_cells, end = result.n_cells, result.makespan_s
    capacity = wl.capacity_per_cell(n_cells)
    bounds = [0.0, *result.update_times]
    if bounds[-1] < end:
        bounds.append(end)
    phases = list(zip(bounds[:-1], bounds[1:], strict=True))
    sums = np.zeros((len(phases), len(KINDS)))
    for cell in range(n_cells):
        segments = [(s, end if e is None else e, kind) for s, e, kind in tl.segments[cell]]
        loads = tl.loads[cell]
        steps = [(t, loads[i + 1][0] if i + 1 < len(loads) else end, v) for i, (t, v) in enumerate(loads)]
        for s, e, kind in segments:
            for p, (p0, p1) in enumerate(phases):
                span = _overlap(s, e, p0, p1)
                if span <= 0:
                    continue
                if kind == "rollout":
                    busy = sum(_overlap(t0, t1, max(s, p0), min(e, p1)) * v for t0, t1, v in steps) / capacity
                    sums[p, 0] += busy
                    sums[p, 1] += span - busy
                elif kind == "train":
                    sums[p, 3] += span  # the micro-steps are moved to train_busy below
                else:
                    sums[p, 4] += span
    for _, start, stop, _, _ in tl.micros:
        for p, (p0, p1) in enumerate(phases):
            span = _overlap(start, stop, p0, p1)
            sums[p, 2] += span
            sums[p, 3] -= span
    return [PhaseProfile(p, p0, p1, *(float(x) for x in sums[p])) for p, (p0, p1) in enumerate(phases)]


def bound_grant_s(result: SimResult, wl: SampledWorkload, optimizer_step_s: float) -> float:
    """Cell-seconds of non-work the lower bound allows: cells x (bound - last optimizer step) less the
    run's rollout occupancy and training work (the bound's start-up or rollout-role term)."""
    n_cells = result.n_cells
    rollout = float(np.sum(wl.duration_s * wl.demand)) / wl.capacity_per_cell(n_cells)
    work = float(np.sum(wl.train_cell_s(n_cells)))
    return max(0.0, n_cells * (result.lower_bound_s - optimizer_step_s) - rollout - work)


def profile_summary(result: SimResult, wl: SampledWorkload, optimizer_step_s: float) -> dict[str, Any]:
    """The profile as one JSON object: per phase, the totals, what the bound grants, and the ratio."""
    phases = waste_profile(result, wl)
    totals = {kind: round(sum(getattr(p, kind) for p in phases), 1) for kind in KINDS}
    non_work = sum(p.non_work_s for p in phases)
    granted = bound_grant_s(result, wl, optimizer_step_s)
    return {
        "cells": result.n_cells,
        "makespan_s": round(result.makespan_s, 1),
        "lower_bound_s": round(result.lower_bound_s, 1),
        "ratio_to_bound": round(result.makespan_s / result.lower_bound_s, 4),
        "totals_cell_s": totals,
        "non_work_cell_s": round(non_work, 1),
        "bound_grants_cell_s": round(granted, 1),
        "phases": [
            {**{k: round(v, 1) for k, v in asdict(p).items() if k != "phase"}, "phase": p.phase}
            for p in phases
        ],
    }
