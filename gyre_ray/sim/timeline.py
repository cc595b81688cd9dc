"""What a simulated run did: per-cell role segments, micro-steps, hosting, and the run's metrics.

`Timeline` is filled by the simulator as events happen; the cheap parts (role segments, launch
and end bookkeeping, released and trained work, update times) are always kept, the bulky parts
(hosting intervals, load curves) only when `record` is set (tests, plots). `SimResult` carries
the metrics the CLI and the benchmark print.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gyre_ray.sim.engine import Simulator


class Timeline:
    """Everything observable about one run, in seconds since its start."""

    def __init__(self, n_cells: int, n_execs: int, steps: int, record: bool) -> None:
        self.record = record
        self.segments: list[list[list[Any]]] = [[] for _ in range(n_cells)]  # [start, end, kind]
        self.micros: list[tuple[int, float, float, int, float]] = []  # cell, start, end, batch, work
        self.loads: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(n_cells)]
        self.hosting: list[list[float]] = []  # [exec, cell, start, end]
        self._open_host: dict[int, int] = {}
        self.launch_time = [math.nan] * n_execs
        self.launch_version = [-1] * n_execs
        self.end_time = [math.nan] * n_execs
        self.end_count = [0] * n_execs
        self.delay_s = [0.0] * n_execs
        self.released = [0.0] * steps
        self.release_events: list[tuple[int, float, float]] = []  # batch, time, work
        self.trained = [0.0] * steps
        self.update_times: list[float] = []

    def segment(self, cell: int, t: float, kind: str) -> None:
        segs = self.segments[cell]
        if segs and segs[-1][1] is None:
            if segs[-1][0] == t:
                segs.pop()  # zero-length
            else:
                segs[-1][1] = t
        if segs and segs[-1][2] == kind and segs[-1][1] == t:
            segs[-1][1] = None  # same kind continues
        else:
            segs.append([t, None, kind])

    def close(self, cell: int, t: float) -> None:
        segs = self.segments[cell]
        if segs and segs[-1][1] is None:
            segs[-1][1] = t

    def micro(self, cell: int, start: float, end: float, batch: int, work: float) -> None:
        self.micros.append((cell, start, end, batch, work))
        self.trained[batch] += work

    def load(self, cell: int, t: float, value: float) -> None:
        if self.record:
            self.loads[cell].append((t, value))

    def host_start(self, e: int, cell: int, t: float) -> None:
        if self.record:
            self._open_host[e] = len(self.hosting)
            self.hosting.append([e, cell, t, math.nan])

    def host_end(self, e: int, cell: int, t: float) -> None:
        if self.record:
            self.hosting[self._open_host.pop(e)][3] = t

    def launch(self, e: int, t: float, version: int) -> None:
        self.launch_time[e], self.launch_version[e] = t, version

    def delay(self, e: int, seconds: float) -> None:
        self.delay_s[e] += seconds

    def end(self, e: int, t: float) -> None:
        self.end_time[e] = t
        self.end_count[e] += 1

    def release(self, batch: int, t: float, work: float) -> None:
        self.released[batch] += work
        self.release_events.append((batch, t, work))

    def update(self, t: float) -> None:
        self.update_times.append(t)

    def result(self, sim: Simulator, makespan: float) -> SimResult:
        wl = sim.wl
        capacity = wl.capacity_per_cell(sim.n_cells)
        rollout_cell_s = float(np.sum(wl.duration_s * wl.demand)) / capacity
        train_cell_s = float(np.sum(self.trained))
        denominator = sim.n_cells * makespan if makespan > 0 else math.inf
        lag = np.asarray(wl.batch) - np.asarray(self.launch_version)
        return SimResult(
            policy=sim.policy.name,
            n_cells=sim.n_cells,
            staleness_bound=sim.staleness,
            steps=sim.steps,
            makespan_s=makespan,
            utilization=(rollout_cell_s + train_cell_s) / denominator,
            rollout_utilization=rollout_cell_s / denominator,
            train_utilization=train_cell_s / denominator,
            mean_staleness=float(lag.mean()) if lag.size else 0.0,
            max_staleness=int(lag.max()) if lag.size else 0,
            switches=sim.switches,
            update_times=list(self.update_times),
            timeline=self,
        )


@dataclass
class SimResult:
    """Metrics of one simulated run (times in seconds)."""

    policy: str
    n_cells: int
    staleness_bound: int
    steps: int
    makespan_s: float
    utilization: float
    rollout_utilization: float
    train_utilization: float
    mean_staleness: float
    max_staleness: int
    switches: int
    update_times: list[float]
    timeline: Timeline = field(repr=False)
    lower_bound_s: float = math.nan
    label: str = ""
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label or self.policy

    def summary(self) -> dict[str, Any]:
        """The JSON row of `gyre-ray simulate --json`."""
        return {
            "makespan_s": round(self.makespan_s, 3),
            "lower_bound_s": round(self.lower_bound_s, 3),
            "utilization": round(self.utilization, 4),
            "mean_staleness": round(self.mean_staleness, 4),
            "switches": self.switches,
            "max_staleness": self.max_staleness,
            "staleness_bound": self.staleness_bound,
            "ratio_to_bound": ratio_or_none(self.makespan_s, self.lower_bound_s),
            "knobs": self.knobs,
        }


def ratio_or_none(numerator: float, denominator: float) -> float | None:
    """`numerator / denominator` rounded to 4 places; None when the denominator is 0 (a workload with no
    work has a lower bound of 0: there is no ratio to show)."""
    return round(numerator / denominator, 4) if denominator > 0 else None
