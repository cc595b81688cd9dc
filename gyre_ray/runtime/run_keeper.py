"""The scheduler actor's record of its run, so a driver that did not start the run can wait for it.

    keeper = RunKeeper()
    keeper.run(key, body)     # the driver's `run` call: body() runs, its result (or error) is kept
                              # (a run `key` under way already: its result, waited for)
    keeper.start(key, body)   # a restarted actor resuming its run: body() in a thread of its own
    keeper.join(key, body)    # a new driver (`gyre-ray train --attach`): that run's result once it
                              # ends; runs body() itself when this actor holds no such run

On a persistent cluster the scheduler actor is detached (`gyre_ray.live_run`): a driver that dies
does not stop the `run` call it made, and the driver that attaches later calls `join` with the same
arguments. A scheduler actor Ray restarts (the run died with the old process) `start`s the run its
journal names by itself (`SchedulerActor`), picking it up from the journal
(`gyre_ray.runtime.reattach`); the `run` call a live driver's Ray retries, and any `join`, then wait
for it. A `join` that finds no run (a journal without the call) starts it, as before.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def run_key(steps: int, options: dict[str, Any]) -> str:
    """What names a run: its arguments (`RunScheduler.run`'s), as one string."""
    return json.dumps({"steps": steps, **options}, sort_keys=True, default=str)


@dataclass
class _Run:
    key: str
    done: threading.Event = field(default_factory=threading.Event)
    outcome: tuple[bool, Any] | None = None  # (raised, result or error)


class RunKeeper:
    """The key (the run's arguments), state and outcome of the last run an actor started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run: _Run | None = None

    def run(self, key: str, body: Callable[[], Any]) -> Any:
        """Start the run `key` now (a later `join(key)` waits for this one) and return its result;
        when run `key` is under way here already (`start`ed by a restarted actor), wait for it."""
        with self._lock:
            run = self._run
            if run is None or run.key != key or run.done.is_set():
                run = self._run = _Run(key)
            else:
                run = None
        if run is None:
            return self.join(key, body)
        return self._execute(run, body)

    def start(self, key: str, body: Callable[[], Any]) -> None:
        """Start the run `key` in a thread of its own and return at once (`run`/`join(key)` wait for it)."""
        with self._lock:
            if self._run is not None and not self._run.done.is_set():
                raise RuntimeError(f"another run is under way here ({self._run.key}), not {key}")
            run = self._run = _Run(key)
        threading.Thread(
            target=self._execute_quietly, args=(run, body), name="resumed-run", daemon=True
        ).start()

    def join(self, key: str, body: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """The result of run `key`: waited for while it runs, at once when it ended (its error raised
        again); `body()` is run here when this actor never started run `key` (never while another
        run is under way: that raises)."""
        with self._lock:
            run, started_here = self._run, False
            if run is not None and run.key != key and not run.done.is_set():
                raise RuntimeError(f"another run is under way here ({run.key}), not {key}")
            if run is None or run.key != key:
                run, started_here = _Run(key), True
                self._run = run
        if started_here:
            return self._execute(run, body)
        if not run.done.wait(timeout_s):
            raise TimeoutError(f"the run did not end within {timeout_s} s")
        raised, value = run.outcome
        if raised:
            raise value
        return value

    def state(self) -> dict[str, Any]:
        """{"key": the last run's key or None, "running": bool, "failed": bool}."""
        with self._lock:
            run = self._run
        if run is None:
            return {"key": None, "running": False, "failed": False}
        outcome = run.outcome
        return {"key": run.key, "running": not run.done.is_set(), "failed": bool(outcome and outcome[0])}

    @classmethod
    def _execute_quietly(cls, run: _Run, body: Callable[[], Any]) -> None:
        """`_execute` in a thread nobody waits on: the error stays in the run's outcome for `join`."""
        try:
            cls._execute(run, body)
        except BaseException:
            logger.exception("the resumed run failed (the next join raises its error)")

    @staticmethod
    def _execute(run: _Run, body: Callable[[], Any]) -> Any:
        try:
            result = body()
        except BaseException as exc:
            run.outcome = (True, exc)
            run.done.set()
            raise
        run.outcome = (False, result)
        run.done.set()
        return result
