"""Issue 8's target, shared by the three `test_sim_near_bound*.py` modules (one preset each, so that
`make test`'s workers run them side by side): the simulator's elastic policy within 5% of the lower
bound on every preset, eta 0 and 1, 2 .. 8 cells (8 steps of the full presets, seed 0; the
benchmark's sweep runs 12, see docs/scheduling.md).

Cases that miss it are listed with their measured ratio in MEASURED_MISSES. Such a case fails if its
ratio rises above the listed one (a scheduling regression), xfails while it stays above 1.05, and
fails once a change brings it within 5% until it is taken off the list, so the list stays the truth.
Slow: 8 x 1,024 executions per simulation; eta 1 tries 7 settings per case (5 prefetch settings,
2 of them again with the sibling launch order), about 8 s a case.
"""

from __future__ import annotations

import pytest

from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_elastic
from gyre_ray.sim.workload import sample_workload

STEPS, SEED, TARGET = 8, 0, 1.05
# The listed ratios are rounded to 4 decimals (up to 5e-5 off); the simulation is seeded.
REGRESSION_TOLERANCE = 1e-4
# Measured elastic / bound at eta = 1 (8 steps, seed 0, best of eager, spare, trickle and paced, in
# FIFO and sibling launch order) where it misses; every eta = 0 case and terminal at 2, 3, 4 and 8
# cells and nl2repo-hard at 8 hold. What is left is what an online policy cannot have: the bound
# may launch each batch's long executions first and park stragglers at window edges
# (docs/scheduling.md, "What the bound grants").
_ETA1_MISSES = {  # preset: {cells: ratio}
    "nl2repo": {2: 1.1441, 3: 1.1092, 4: 1.0946, 5: 1.0855, 6: 1.0806, 7: 1.0746, 8: 1.0697},
    "nl2repo-hard": {2: 1.1343, 3: 1.0683, 4: 1.0731, 5: 1.0719, 6: 1.0630, 7: 1.0532},
    "terminal": {5: 1.0624, 6: 1.0669, 7: 1.0547},
}
MEASURED_MISSES: dict[tuple[str, int, int], float] = {
    (name, 1, cells): ratio for name, by_cells in _ETA1_MISSES.items() for cells, ratio in by_cells.items()
}
_WORKLOADS: dict = {}


def workload(name: str):
    if name not in _WORKLOADS:
        _WORKLOADS[name] = sample_workload(PRESETS[name], STEPS, SEED)
    return _WORKLOADS[name]


def cases(name: str) -> list:
    return [
        pytest.param(eta, cells, id=f"{name}-eta{eta}-{cells}cells")
        for eta in (0, 1)
        for cells in range(2, 9)
    ]


def check_case(name: str, eta: int, cells: int) -> None:
    """Assert the target for one case, or (listed misses) no regression, then xfail."""
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
