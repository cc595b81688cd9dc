"""Issue 8's target: the simulator's elastic policy within 5% of the lower bound on every preset, eta 0 and 1,
2 .. 8 cells (8 steps of the full presets, seed 0; the benchmark's sweep runs 12, see docs/scheduling.md).

Cases that miss it are listed in MISSES and marked xfail(strict): if a change brings one within 5%,
the test fails until it is taken off the list, so the list stays the truth. Slow: 42 simulations of
8 x 1,024 executions (about 3 minutes on 2 idle cores).
"""

from __future__ import annotations

import pytest

from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_elastic
from gyre_ray.sim.workload import sample_workload

STEPS, SEED, TARGET = 8, 0, 1.05
# Measured elastic / bound at eta = 1 (8 steps, seed 0) where it misses; every eta = 0 case and
# terminal at 2 and 3 cells (1.035, 1.048) hold. What is left is what an online policy cannot have:
# the bound may launch each batch's long executions first and park stragglers at window edges
# (docs/scheduling.md, "What the bound grants").
_ETA1_MISSES = {  # preset: (first cell count, ratios from there to 8 cells)
    "nl2repo": (2, (1.197, 1.157, 1.117, 1.102, 1.093, 1.087, 1.083)),
    "nl2repo-hard": (2, (1.135, 1.109, 1.089, 1.076, 1.063, 1.058, 1.051)),
    "terminal": (4, (1.057, 1.063, 1.068, 1.062, 1.055)),
}
MEASURED_MISSES: dict[tuple[str, int, int], float] = {
    (name, 1, first + i): ratio
    for name, (first, ratios) in _ETA1_MISSES.items()
    for i, ratio in enumerate(ratios)
}
MISSES = set(MEASURED_MISSES)
_WORKLOADS: dict = {}


def workload(name: str):
    if name not in _WORKLOADS:
        _WORKLOADS[name] = sample_workload(PRESETS[name], STEPS, SEED)
    return _WORKLOADS[name]


def cases() -> list:
    out = []
    for name in PRESETS:
        for eta in (0, 1):
            for cells in range(2, 9):
                marks = []
                if (name, eta, cells) in MISSES:
                    reason = f"elastic at {MEASURED_MISSES[name, eta, cells]:.3f}x the bound (target 1.05x)"
                    marks = [pytest.mark.xfail(strict=True, reason=reason)]
                out.append(pytest.param(name, eta, cells, marks=marks, id=f"{name}-eta{eta}-{cells}cells"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "eta", "cells"), cases())
def test_elastic_within_5_percent_of_the_bound(name: str, eta: int, cells: int) -> None:
    result = best_elastic(workload(name), cells, eta)
    assert result.makespan_s >= result.lower_bound_s  # the bound is a bound
    assert result.makespan_s <= TARGET * result.lower_bound_s, (
        f"{result.makespan_s / result.lower_bound_s:.3f}x"
    )
