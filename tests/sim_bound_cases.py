"""Issue 8's target, shared by the three `test_sim_near_bound*.py` modules (one preset each, so that
`make test`'s workers run them side by side): the simulator's elastic policy within 5% of the lower
bound on every preset, eta 0 and 1, 2 .. 8 cells (8 steps of the full presets, seed 0; the
benchmark's sweep runs 12, see docs/scheduling.md).

Cases that miss it are listed with their measured ratio in MEASURED_MISSES. Such a case fails if its
ratio rises above the listed one (a scheduling regression), xfails while it stays above 1.05, and
fails once a change brings it within 5% until it is taken off the list, so the list stays the truth.

The elastic policy's figure is `best_elastic`'s: the fastest of 7 settings at eta 1 (5 prefetch
settings, 2 of them again with the sibling launch order). `make test` runs, for each eta-1 case, only
the setting listed in WINNERS (one simulation of 8 x 1,024 executions, 1-3 s, instead of seven,
about 12 s on 2 cores); the `extended` tests (`check_search`, `make test-extended`) run the whole
search and fail when another setting has come to win, so the pinned run stays `best_elastic`'s.
"""

from __future__ import annotations

import pytest

from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_elastic, elastic_candidates, run_policy
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
    "nl2repo": {2: 1.1442, 3: 1.1092, 4: 1.0946, 5: 1.0855, 6: 1.0806, 7: 1.0746, 8: 1.0697},
    "nl2repo-hard": {2: 1.1343, 3: 1.0683, 4: 1.0731, 5: 1.0719, 6: 1.0630, 7: 1.0532},
    "terminal": {5: 1.0624, 6: 1.0669, 7: 1.0547},
}
MEASURED_MISSES: dict[tuple[str, int, int], float] = {
    (name, 1, cells): ratio for name, by_cells in _ETA1_MISSES.items() for cells, ratio in by_cells.items()
}
# The setting that wins each eta = 1 case (`best_elastic`'s candidate label; measured 2026-12-07: its
# makespan is the search's, to the second; ties go to the first label the search tries, as there).
_ETA1_WINNERS = {  # preset: {cells: label}
    "nl2repo": {2: "trickle:sibling", 3: "paced:8100", 4: "paced:8100", 5: "paced:8100", 6: "paced:8100",
                7: "paced:8100", 8: "paced:8100"},
    "nl2repo-hard": {2: "paced:28800:sibling", 3: "paced:28800", 4: "paced:43200", 5: "paced:28800",
                     6: "spare", 7: "paced:28800:sibling", 8: "paced:28800:sibling"},
    "terminal": {2: "trickle:sibling", 3: "trickle:sibling", 4: "trickle:sibling", 5: "paced:3600:sibling",
                 6: "trickle", 7: "trickle:sibling", 8: "trickle:sibling"},
}  # fmt: skip
WINNERS: dict[tuple[str, int, int], str] = {
    (name, 1, cells): label for name, by_cells in _ETA1_WINNERS.items() for cells, label in by_cells.items()
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


def pinned_elastic(name: str, eta: int, cells: int):
    """`best_elastic`'s result for one case: at eta 1, its winning setting (WINNERS) run alone."""
    wl = workload(name)
    if eta == 0:  # one setting: without prefetch the modes decide the same
        return best_elastic(wl, cells, eta)
    knobs = elastic_candidates(wl)[WINNERS[(name, eta, cells)]]
    return run_policy(wl, "elastic", cells, eta, **knobs)


def check_search(name: str, cells: int) -> None:
    """The whole search at eta 1 finds no faster setting than the one WINNERS lists."""
    searched = best_elastic(workload(name), cells, 1)
    sweep = searched.knobs["sweep_makespan_s"]
    label = WINNERS[(name, 1, cells)]
    fastest = min(sweep, key=sweep.get)
    assert sweep[label] == sweep[fastest], (
        f"{fastest} now wins ({sweep[fastest]:.0f} s against {label}'s {sweep[label]:.0f} s): "
        f"update WINNERS in tests/sim_bound_cases.py"
    )
    assert searched.makespan_s == pinned_elastic(name, 1, cells).makespan_s


def check_case(name: str, eta: int, cells: int) -> None:
    """Assert the target for one case, or (listed misses) no regression, then xfail."""
    result = pinned_elastic(name, eta, cells)
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
