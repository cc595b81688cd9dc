"""What a restarted scheduler actor does: it picks up the run where the dead one left it.

The scheduler actor runs with `max_restarts` (`run.max_scheduler_restarts`) and its calls with task
retries, so when its process dies Ray starts a new one with the same arguments. The new actor
resumes the journaled `run` call by itself (`SchedulerActor`: the journal holds the call's
arguments), so the run goes on with no driver alive; the driver's `run` call that Ray sends again,
or an attaching driver's `join`, waits for that run. `SchedulerReattach` (a part of `RunScheduler`) then rebuilds the run's
state from what outlived the old process:

- the journal (`gyre_ray.runtime.journal`): which executions were launched and on which cell, which
  ended with which outcome, which steps were published (their metrics);
- the `workers` actor, which the runtime (not the scheduler) owns: the harnesses of the executions in
  flight keep running there, their calls go on through the proxy into the store, and
  `workers.outcome_of` hands their outcomes to the new scheduler. An execution the old scheduler
  journaled but never got to hand over is launched again (with a key the store issues anew);
- the store: finished groups are processed again from their records (the same micro-batches);
- the cells: each is asked for its role and version and brought back to rollout on the published
  version, undrained. Training of the step in progress starts again from its micro-batches: the
  gradients summed so far (core and satellites) are dropped, so nothing is counted twice. If the
  core had already taken the step's optimizer step (its version is ahead of the journal), that
  update counts as done and is published. With `elastic_duration_prior: auto` the sibling order's
  duration model is fitted again from the journaled outcomes (as at a step's end). A cell that
  died with the old scheduler (cells it had restarted are detached now, but a kill may hit both)
  is restarted as after any cell loss.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from gyre_ray.agents.runner import ExecutionOutcome
from gyre_ray.proxy.store import actor_was_restarted
from gyre_ray.runtime.journal import JournalState, RunJournal
from gyre_ray.runtime.recovery import is_cell_loss
from gyre_ray.runtime.runners import executor_name
from gyre_ray.runtime.work import RunningExecution, Switch
from gyre_ray.scheduling.runtime import CellPhase

SETTLE_READS = 3  # consecutive identical role reads of every cell before the reset counts as done
CALL_TIMEOUT_S = 300.0


class SchedulerReattach:
    """Journal writes during a run, and the reattach of a restarted scheduler (module docstring)."""

    def _open_journal(self, header: dict[str, Any], version: int) -> JournalState | None:
        """Replay the journal if this actor was restarted during the same run; else start a new one."""
        self.scheduler_restarts: list[dict[str, Any]] = []
        if getattr(self, "journal", None) is not None:  # the previous run's
            self.journal.close()
        restarted = actor_was_restarted()
        state = RunJournal.replay(self.run_dir, header) if restarted else None
        if state is None:
            self.journal = RunJournal.begin(self.run_dir, header, version, getattr(self, "call", None))
            if restarted:  # died before this run's journal began: the cells may be mid-switch (a cell
                self._reset_cells()  # found dead there is journaled as a fault: the journal comes first)
            return None
        self.journal = RunJournal.resume(self.run_dir)
        return state

    def _go_on_with_clock(self, state: JournalState) -> None:
        """Run on the dead actor's clock (its journaled `clock`, read through `time.time()`, so another
        node's clock skew shifts it), so launches, ends, spans and publishes before and after the
        restart share one time line, and the run's timeout still counts from its start; a journal
        without one (written before clocks were journaled) keeps this actor's clock and journals it."""
        if state.clock_wall is not None:
            self.t0 = time.monotonic() - max(0.0, time.time() - state.clock_wall)
        else:
            self.journal.clock(time.time() - (time.monotonic() - self.t0))
        self.recorder.last_publish = state.last_publish_s

    def _reattach(self, state: JournalState) -> None:
        """Rebuild the run from `state`, the cells, `workers` and the store (module docstring)."""
        started = time.monotonic()
        for row in state.published:
            self.step_metrics.append(row["metrics"])
        self.faults.extend(state.faults)
        self.runner_losses.extend(state.runner_losses)
        self.lost_runners.update(loss["runner"] for loss in state.runner_losses if loss["runner"] is not None)
        self.recorder.exec_stats.update(state.exec_stats)
        self.updates = max([self.first_step, *(row["batch"] + 1 for row in state.published)])
        expected = state.published[-1]["version"] if state.published else state.start_version
        recovered_update = self.trainer_version > expected and self.updates < self.steps
        reset = self._reset_cells()
        booked = self._rebook(state)
        if recovered_update:  # the core stepped; the old scheduler died before the publish was journaled
            metrics = {
                "step": self.updates,
                "version": self.trainer_version,
                "recovered_after_scheduler_restart": True,
            }
            self.journal.published(self.updates, self.trainer_version, metrics)
            self.step_metrics.append(metrics)
            self.updates += 1
        for group in self.groups:
            self._process_if_ended(group, self._now())
        self.scheduler_restarts.append({
            "at_step": self.updates, "executions_reattached": booked["running"],
            "executions_ended_before": booked["ended"], "executions_relaunched": 0,
            "cells_reset": reset, "update_recovered": recovered_update,
            "reattach_s": round(time.monotonic() - started, 3),
        })  # fmt: skip
        if self.cfg.scheduler.fits_duration_prior and self.updates > self.first_step:
            # the dead actor's policy held a fit of the ended executions; without this refit the new
            # one would launch in id order until the next step's end
            self.scheduler_restarts[-1]["duration_model"] = self._refit_duration_prior()

    def _rebook(self, state: JournalState) -> dict[str, int]:
        """Executions the journal knows: ended ones with their outcome, the others reattached."""
        counts = {"ended": 0, "running": 0}
        live = [i for i, v in enumerate(self.views) if not self._restarting(i) and not v.lost]
        for exec_id, cell in sorted(state.launched.items()):
            cell = cell if cell in live else live[0]
            facts = state.launches.get(exec_id, {})  # the launch's time and version (older journals: none)
            start, version = float(facts.get("at_s", 0.0)), int(facts.get("version", self.trainer_version))
            if (current := facts.get("execution_id")) and current != self.planned[exec_id].execution_id:
                # started again after its runner died (`RunnerRecovery`): the id of its last launch
                self.planned[exec_id] = dataclasses.replace(self.planned[exec_id], execution_id=current)
            self.ledger.launch(exec_id, cell, start, version)
            self.recorder.launched(exec_id, start, version)
            if exec_id in state.outcomes:
                outcome = ExecutionOutcome(**state.outcomes[exec_id])
                self.outcomes[exec_id] = outcome
                self.ledger.end(exec_id, outcome.duration_s, outcome.timed_out)
                self.recorder.ended(exec_id, state.ended_at.get(exec_id, start + outcome.duration_s), outcome)
                counts["ended"] += 1
                continue
            runner = state.runners.get(exec_id) if self.runners else None
            where = self.workers if runner is None else self.runners[runner]
            ref = where.outcome_of.remote(self.planned[exec_id].execution_id)
            self.running[ref] = RunningExecution(exec_id, cell, start, version, runner)
            self.recorder.ran_on(exec_id, executor_name(runner))
            counts["running"] += 1
        return counts

    def _relaunch(self, run: RunningExecution) -> None:
        """An execution journaled as launched that its executor does not know: the old scheduler died
        before handing it over, or the executor died since and Ray started a new one (whose harness
        may have left records). Start it again under a new id (`RunnerRecovery._start_again`), within
        the same bound on starts as any lost execution."""
        self._start_again(run)
        if self.scheduler_restarts:
            self.scheduler_restarts[-1]["executions_relaunched"] += 1

    def _reset_cells(self) -> int:
        """Every live cell back to rollout, undrained, on the published version, holding no gradients;
        a dead one restarted. Repeated until every cell reads the same `SETTLE_READS` (3) times in a
        row (a switch the old scheduler started may still be finishing). Returns how many cells
        needed a reset."""
        reset: set[int] = set()
        last: list[Any] = []
        reads = 0
        while reads < SETTLE_READS:
            seen = []
            for index, actor in enumerate(self.actors):
                if self._restarting(index):
                    seen.append("restarting")
                    continue
                if self.views[index].lost:  # found dead and not restarted (no pool): asked no more
                    seen.append("lost")
                    continue
                try:
                    status = ray.get(actor.status.remote(), timeout=60)
                    if self._reset_cell(index, status):
                        reset.add(index)
                except Exception as exc:
                    if not is_cell_loss(exc):
                        raise
                    self._cell_lost(index, f"{type(exc).__name__} (found by the restarted scheduler)")
                    seen.append("restarting")
                    continue
                seen.append((status["role"], status["draining"], status["unexported_micro_batches"]))
            reads = reads + 1 if seen == last else 1
            last = seen
            if reads < SETTLE_READS:
                time.sleep(0.5)
        core = self.actors[self.core]
        if ray.get(core.discard_grads.remote(), timeout=CALL_TIMEOUT_S):
            reset.add(self.core)
        return len(reset)

    def _reset_cell(self, index: int, status: dict[str, Any]) -> bool:
        actor, core = self.actors[index], index == self.core
        version = (status.get("engine") or {}).get("version")
        if not status.get("engine") and not core:  # restarted by the old scheduler, never rejoined
            self._rejoin_restarted(index)
            return True
        if status["role"] == "train":
            weights = None if core else self.weights
            call = actor.switch_to_rollout.remote(weights, self.trainer_version, discard_grads=True)
        elif version is not None and version < self.trainer_version:
            call = actor.load_and_undrain.remote(self.weights, self.trainer_version)
        elif status["draining"]:
            call = actor.undrain.remote()
        else:
            return False
        ray.get(call, timeout=CALL_TIMEOUT_S)
        self.views[index].enter(CellPhase.ROLLOUT, self._now())
        return True

    def _rejoin_restarted(self, index: int) -> None:
        """A cell the old scheduler had restarted (a new actor, drained, engine not built): rejoin it
        as after a restart here (`CellRecovery._rejoin_done` undrains it)."""
        view = self.views[index]
        event = next((f for f in reversed(self.faults) if f.get("cell") == view.cell_id), None)
        if event is None:
            event = {"cell": view.cell_id, "lost": "restarted by the previous scheduler", "restarted": True}
            self.faults.append(event)
        ref = self.actors[index].rejoin.remote(self.weights, self.trainer_version)
        self.restarts[ref] = Switch(index, "restart", self._now(), self.trainer_version, event=event)
        self.recorder.phase(index, view, CellPhase.TO_ROLLOUT, self._now())
