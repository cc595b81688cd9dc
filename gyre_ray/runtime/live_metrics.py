"""The scheduler actor's live metrics for the Ray dashboard (`gyre_ray.observability.ray_metrics`).

    live = LiveMetrics()                  # in `Scheduler.run`
    live.tick(sched)                      # every loop turn (gauges at most once a second)
    live.micro_step(cell_id, metrics)     # tokens trained, per cell
    live.switched(direction, seconds)     # switch latency
    live.step_done(step_metrics)          # staleness of the update's tokens, version
    live.poll_engines(sched)              # tokens generated, at each step's end too

Tokens generated per cell come from the cells' engine counters (`decode_tokens`), read every few
seconds; the same poll keeps the model calls each engine holds beyond its decode slots
(`waiting_calls`), which the scheduler passes to the policy as `queued_demand`. A metrics failure never disturbs the run.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from gyre_ray.observability.ray_metrics import RuntimeMetrics
from gyre_ray.scheduling.runtime import CellPhase

GAUGE_PERIOD_S = 1.0
ENGINE_POLL_S = 5.0
_SWITCHING = (CellPhase.TO_TRAIN, CellPhase.TO_ROLLOUT)


class LiveMetrics:
    """Turns the scheduler's state and events into Ray metrics."""

    def __init__(self) -> None:
        self.metrics = RuntimeMetrics.create()
        self._gauges_at = 0.0
        self._engines_at = 0.0
        self._decoded: dict[str, int] = {}
        self.waiting_calls: dict[int, int] = {}  # cell index -> calls queued beyond its engine's slots

    def tick(self, sched: Any) -> None:
        now = time.monotonic()
        if now - self._gauges_at >= GAUGE_PERIOD_S:
            self._gauges_at = now
            with contextlib.suppress(Exception):
                self._gauges(sched)
        if now - self._engines_at >= ENGINE_POLL_S:
            self.poll_engines(sched)

    def poll_engines(self, sched: Any) -> None:
        """Read the cells' engine counters now (every few seconds, and at each step's end, so a
        step shorter than the poll period still counts its tokens)."""
        self._engines_at = time.monotonic()
        with contextlib.suppress(Exception):
            self._generated(sched)

    def _gauges(self, sched: Any) -> None:
        roles = {"rollout": 0, "train": 0, "switching": 0}
        for view in sched.views:
            if view.lost:  # out of the run: no role
                continue
            if view.phase in _SWITCHING:
                roles["switching"] += 1
            elif view.phase is CellPhase.ROLLOUT:
                roles["rollout"] += 1
            else:
                roles["train"] += 1
        self.metrics.cells_by_role(roles)
        self.metrics.execution_counts(len(sched.running), len(sched.ledger.pending))
        stream = sched.streams.get(sched.updates)
        self.metrics.queue_depth(stream.queued if stream is not None else 0)

    def _generated(self, sched: Any) -> None:
        import ray

        # a cell being restarted builds its engine with its event loop held (or waits for its bundle):
        # asking it would hold the scheduler's loop for the whole timeout at every poll; a cell lost for
        # good is dead (its failed call would void every poll)
        cells = [i for i in range(len(sched.actors)) if not sched._restarting(i) and not sched.views[i].lost]
        statuses = ray.get([sched.actors[i].status.remote() for i in cells], timeout=5)
        self.waiting_calls = {
            i: _beyond_slots(s.get("engine", {})) for i, s in zip(cells, statuses, strict=True)
        }
        self.count_generated(statuses)

    def count_generated(self, statuses: list[dict[str, Any]]) -> None:
        """Tokens each cell's engine decoded since the last poll. An engine's counter starts at 0, so
        the first poll counts all it decoded before; a counter that went down is a restarted cell's
        new engine, counted from 0 again."""
        for status in statuses:
            cell, decoded = status["cell_id"], int(status.get("engine", {}).get("decode_tokens", 0))
            before = self._decoded.get(cell, 0)
            new = decoded - before if decoded >= before else decoded
            if new > 0:
                self.metrics.tokens(cell, generated=new)
            self._decoded[cell] = decoded

    def micro_step(self, cell_id: str, metrics: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            self.metrics.tokens(cell_id, trained=int(metrics.get("loss_tokens", 0)))

    def switched(self, direction: str, seconds: float) -> None:
        with contextlib.suppress(Exception):
            self.metrics.switch_latency(direction, seconds)

    def step_done(self, step: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            hist = step.get("staleness", {}).get("hist", {})
            self.metrics.trained_staleness({int(lag): int(n) for lag, n in hist.items()})
            self.metrics.published(int(step["version"]))


def _beyond_slots(engine: dict[str, Any]) -> int:
    """Model calls an engine holds beyond its decode slots (a request waiting for its prefill round
    while slots are free is not queued demand)."""
    running, waiting = int(engine.get("running", 0)), int(engine.get("waiting", 0))
    slots = int(engine.get("max_batch_size", running + waiting))
    return max(0, running + waiting - slots)
