"""Issue 8's target: the simulator's elastic policy within 5% of the lower bound on every preset, eta 0 and 1,
2 .. 8 cells (8 steps of the full presets, seed 0; the benchmark's sweep runs 12, see docs/scheduling.md).

Cases that miss it are listed with their measured ratio in MEASURED_MISSES. Such a case fails if its
ratio rises above the listed one (a scheduling regression), xfails while it stays above 1.05, and
fails once a change brings it within 5% until it is taken off the list, so the list stays the truth.
Slow: 112 simulations of 8 x 1,024 executions (eta 1 tries 5 prefetch settings per case); `make test`
runs them all, 71 s in one process (2026-12-04).
"""

from __future__ import annotations

import pytest

from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_elastic
from gyre_ray.sim.workload import sample_workload

STEPS, SEED, TARGET = 8, 0, 1.05
# The listed ratios are rounded to 4 decimals (up to 5e-5 off); the simulation is seeded.
REGRESSION_TOLERANCE = 1e-4
# Measured elastic / bound at eta = 1 (8 steps, seed 0, best of eager, spare, trickle and paced)
# where it misses; every eta = 0 case and terminal at 2, 3 and 8 cells (1.0336, 1.0439, 1.0480)
# hold. What is left is what an online policy cannot have: the bound may launch each batch's long
# executions first and park stragglers at window edges (docs/scheduling.md, "What the bound grants");
# launched longest first (`longest_first`, clairvoyant), 13 of these 18 come within 5% (the table there).
_ETA1_MISSES = {  # preset: (first cell count, ratios from there)
    "nl2repo": (2, (1.1854, 1.1092, 1.0946, 1.0855, 1.0806, 1.0746, 1.0697)),
    "nl2repo-hard": (2, (1.1352, 1.0683, 1.0731, 1.0719, 1.0630, 1.0585, 1.0504)),
    "terminal": (4, (1.0529, 1.0627, 1.0669, 1.0610)),
}
MEASURED_MISSES: dict[tuple[str, int, int], float] = {
    (name, 1, first + i): ratio
    for name, (first, ratios) in _ETA1_MISSES.items()
    for i, ratio in enumerate(ratios)
}
_WORKLOADS: dict = {}


def workload(name: str):
    if name not in _WORKLOADS:
        _WORKLOADS[name] = sample_workload(PRESETS[name], STEPS, SEED)
    return _WORKLOADS[name]


def cases() -> list:
    return [
        pytest.param(name, eta, cells, id=f"{name}-eta{eta}-{cells}cells")
        for name in PRESETS
        for eta in (0, 1)
        for cells in range(2, 9)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "eta", "cells"), cases())
def test_elastic_within_5_percent_of_the_bound(name: str, eta: int, cells: int) -> None:
    result = best_elastic(workload(name), cells, eta)
    assert result.makespan_s >= result.lower_bound_s  # the bound is a bound
    ratio = result.makespan_s / result.lower_bound_s
    measured = MEASURED_MISSES.get((name, eta, cells))
    if measured is None:
        assert ratio <= TARGET, f"{ratio:.4f}x the bound (target {TARGET}x)"
        return
    assert ratio <= measured + REGRESSION_TOLERANCE, (
        f"{ratio:.4f}x the bound, worse than the {measured:.4f}x listed"
    )
    assert ratio > TARGET, f"{ratio:.4f}x: within {TARGET}x now; take this case off MEASURED_MISSES"
    pytest.xfail(f"elastic at {ratio:.4f}x the bound (target {TARGET}x)")
