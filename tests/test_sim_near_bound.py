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
# Every eta = 1 case misses (1.04x to 1.23x the bound): the bound there is its work part, which
# assumes rollout cells always full, and no online policy keeps them full while the staleness bound
# forbids the next launches (docs/scheduling.md, "Pipelined steps").
MISSES: set[tuple[str, int, int]] = {(name, 1, cells) for name in PRESETS for cells in range(2, 9)}
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
                    marks = [pytest.mark.xfail(strict=True, reason="elastic misses 5% of the bound here")]
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
