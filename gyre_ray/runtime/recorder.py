"""What the scheduler measures as the run goes: executions, cell phases, switches, micro-steps, updates.

`RunRecorder` is fed by `gyre_ray.runtime.scheduler.RunScheduler` at every event and turns that into
the per-step metrics (staleness of trained tokens, overlap of later rollout with this step's
training, switches), the execution trace and the measured costs (`gyre_ray.runtime.report`).
Times are seconds since the run started.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from gyre_ray.agents.outcomes import outcome_metrics
from gyre_ray.runtime.report import overlap_seconds, staleness_summary, utilisation
from gyre_ray.runtime.runners import WORKERS_NAME
from gyre_ray.scheduling.runtime import CellPhase
from gyre_ray.scheduling.state import Role

_PHASE_KIND = {
    CellPhase.TRAINING: "training",
    CellPhase.TO_TRAIN: "switching",
    CellPhase.TO_ROLLOUT: "switching",
}


# per-micro-batch sums of the loss's metrics (gyre_ray.algo.gspo) that add up over a step
_POLICY_SUMS = ("nll_sum", "kl_sum", "loss_tokens", "sequences", "clipped_sequences")


def _mean(values: list[float], default: float = 0.0) -> float:
    return statistics.fmean(values) if values else default


def policy_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A step's policy statistics from its micro-batches' summed loss metrics: mean negative log-prob
    of the sampled tokens under the behaviour policy, k3 KL(behaviour || trained policy) per token,
    and the share of sequences whose importance ratio lies outside the clip range."""
    tokens, sequences = sums.get("loss_tokens", 0.0), sums.get("sequences", 0.0)
    if not tokens:
        return {}
    return {
        "nll_mean": sums.get("nll_sum", 0.0) / tokens,
        "kl_behaviour": sums.get("kl_sum", 0.0) / tokens,
        "clip_fraction": sums.get("clipped_sequences", 0.0) / sequences if sequences else 0.0,
    }


def rewards_by_task(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """Mean reward per task id from (task id, reward) pairs of valid executions."""
    grouped: dict[str, list[float]] = {}
    for task, reward in pairs:
        grouped.setdefault(task, []).append(reward)
    return {task: statistics.fmean(values) for task, values in sorted(grouped.items())}


def trace_row(
    span: tuple[float, float],
    task: str,
    step: int,
    exec_id: str,
    version: int,
    outcome: tuple[bool, bool, float] | None,
    stats: Mapping[str, Any],
    runner: str,
) -> dict[str, Any]:
    """One `trace.jsonl` row: an execution launched at `span[0]` on policy `version`, ended at `span[1]`
    (seconds on the recorder's clock) with `outcome` (timed_out, valid, reward; None: no outcome came
    back), `stats` its group's figures of it (calls, tokens, trajectories kept), run by the actor
    `runner` (`workers` or `runner-<i>`)."""
    timed_out, valid, reward = outcome if outcome is not None else (False, False, 0.0)
    return {
        "start": round(span[0], 4),
        "end": round(span[1], 4),
        "task": task,
        "step": step,
        "timed_out": bool(timed_out),
        "exec_id": exec_id,
        "calls": int(stats.get("calls", 0)),
        "tokens": int(stats.get("tokens", 0)),
        "trajectories": int(stats.get("trajectories", 0)),
        "dropped": not valid,
        "version": version,
        "reward": round(reward, 6) if valid else None,
        "runner": runner,
    }


class RunRecorder:
    """Bookkeeping of measurements; no Ray, no decisions."""

    def __init__(self, cell_ids: list[str]) -> None:
        self.ids = list(cell_ids)
        self.t0 = 0.0
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}
        self.version: dict[int, int] = {}
        self.outcome: dict[int, Any] = {}
        self.runner: dict[int, str] = {}  # the actor each execution (last) ran in
        self.spans: list[tuple[str, str, float, float]] = []
        self._busy: dict[int, float] = {}
        self.switch_seconds: dict[str, list[float]] = {"to_train": [], "to_rollout": []}
        self.events: list[dict[str, Any]] = []
        self.drains: list[float] = []
        self.micro_seconds: list[float] = []
        self.losses: dict[int, list[float]] = {}
        self.gaps: dict[int, float] = {}
        self.policy_sums: dict[int, dict[str, float]] = {}
        self.trees: dict[int, list[dict[str, Any]]] = {}
        self.exec_stats: dict[str, dict[str, Any]] = {}
        self.train_start: dict[int, float] = {}
        self.update_times: dict[str, list[float]] = {"grads": [], "step": [], "publish": []}
        self.group_seconds: list[float] = []
        self.last_publish = 0.0

    # ---- feeds ----------------------------------------------------------------------------------
    def launched(self, exec_id: int, now: float, version: int) -> None:
        self.start[exec_id], self.version[exec_id] = now, version

    def ran_on(self, exec_id: int, actor: str) -> None:
        self.runner[exec_id] = actor

    def ended(self, exec_id: int, now: float, outcome: Any) -> None:
        self.end[exec_id], self.outcome[exec_id] = now, outcome

    def loads(self, sched: Any, now: float) -> None:
        """Open / close each cell's 'rollout' span as it starts / stops hosting executions."""
        for i, view in enumerate(sched.views):
            busy = view.role is Role.ROLLOUT and view.ready and bool(sched.ledger.on_cell(i))
            if busy and i not in self._busy:
                self._busy[i] = now
            elif not busy and i in self._busy:
                self.spans.append((self.ids[i], "rollout", self._busy.pop(i), now))

    def phase(self, index: int, view: Any, phase: CellPhase, now: float) -> None:
        """`view` enters `phase`; the span of the phase it leaves is kept when it is work."""
        kind = _PHASE_KIND.get(view.phase)
        if kind is not None:
            self.spans.append((self.ids[index], kind, view.since, now))
        view.enter(phase, now)

    def switched(self, direction: str, seconds: float, event: dict[str, Any]) -> None:
        self.switch_seconds[direction].append(seconds)
        self.events.append(event)

    def mean_switch(self, direction: str) -> float:
        return _mean(self.switch_seconds[direction])

    def micro_step(self, step: Any, metrics: dict[str, Any], seconds: float) -> None:
        self.micro_seconds.append(seconds)
        self.losses.setdefault(step.batch, []).append(float(metrics["loss"]))
        gap = float(metrics.get("logprob_gap_max", 0.0))
        self.gaps[step.batch] = max(self.gaps.get(step.batch, 0.0), gap)
        sums = self.policy_sums.setdefault(step.batch, {})
        for key in _POLICY_SUMS:
            sums[key] = sums.get(key, 0.0) + float(metrics.get(key, 0.0))

    def mean_micro_step(self) -> float:
        return _mean(self.micro_seconds, 1.0)

    def train_started(self, batch: int, now: float) -> None:
        self.train_start.setdefault(batch, now)

    def group_processed(self, batch: int, result: Any, seconds: float) -> None:
        self.trees.setdefault(batch, []).extend(result.trees)
        self.exec_stats.update(result.executions)
        self.group_seconds.append(seconds)

    # ---- per step -------------------------------------------------------------------------------
    def step_done(self, sched: Any, update: Any, now: float) -> dict[str, Any]:
        """The metrics of update `update.batch`, just published at `now`."""
        b = update.batch
        for stage, seconds in update.times.items():
            self.update_times[stage].append(seconds)
        execs = [e for e, batch in enumerate(sched.ledger.batch_of) if batch == b]
        outcomes = [self.outcome[e] for e in execs]
        rewards = [o.reward for o in outcomes if o.valid]
        trees = self.trees.get(b, [])
        stream = sched.streams[b]
        stepped = "version" in update.metrics
        trained_version = update.version - 1 if stepped else update.version
        staleness = staleness_summary(
            trained_version, (sched.token_versions[(b, i)] for i in range(len(stream.items)))
        )
        window = (self.train_start.get(b, update.since), now)
        later = [(self.start[e], self.end.get(e, now)) for e in self.start if sched.ledger.batch_of[e] > b]
        early = [e for e in self.start if sched.ledger.batch_of[e] > b]
        # each switch in the step in which it ended (an event is kept when its switch ends, stamped
        # with its start: one that began before the last publish and ended after it is this step's)
        switches = [e for e in self.events if self.last_publish < e["at_s"] + e.get("seconds", 0.0) <= now]
        metrics: dict[str, Any] = {
            "step": b,
            "executions": len(outcomes),
            "valid": sum(o.valid for o in outcomes),
            "timed_out": sum(o.timed_out for o in outcomes),
            "reward_mean": statistics.fmean(rewards) if rewards else None,  # None: no execution scored
            "reward_by_task": rewards_by_task(
                [
                    (sched.planned[e].task.task_id, o.reward)
                    for e, o in zip(execs, outcomes, strict=True)
                    if o.valid
                ]
            ),
            "calls": sum(t["calls"] for t in trees),
            "paths_total": sum(t["paths_total"] for t in trees),
            "paths_selected": sum(t["paths_selected"] for t in trees),
            "tokens_expanded_all": sum(t["tokens_expanded_all"] for t in trees),
            "tokens_packed_selected": sum(t["tokens_packed_selected"] for t in trees),
            "loss_tokens": sum(t["loss_tokens_selected"] for t in trees),
            # advantage 0 (their group's rewards all equal): counted in the step's mean, not trained
            "executions_untrained": len(stream.counted),
            "micro_batches": len(stream.items),
            "trained_by_cell": stream.trained_by_cell(),
            "switches": switches,
            "staleness": staleness,
            "overlap_s": round(overlap_seconds([window], later), 3),
            "later_executions_started": len(early),
            "step_seconds": round(now - (self.last_publish or min(self.start.values())), 3),
            "published_at_s": round(now, 3),
            "update_s": {k: round(v, 4) for k, v in update.times.items()},
            "version": update.version,
            **outcome_metrics(outcomes),  # dropped executions and every reason, per execution
        }
        if stepped:
            metrics.update(
                loss=sum(self.losses.get(b, [])),
                grad_norm=update.metrics.get("grad_norm"),
                logprob_gap_max=self.gaps.get(b, 0.0),
                **policy_metrics(self.policy_sums.get(b, {})),
            )
        else:
            metrics["skipped"] = update.metrics.get("skipped", "no update")
        self.last_publish = now
        return metrics

    # ---- end of run -----------------------------------------------------------------------------
    def costs(self, **fixed: Any) -> dict[str, Any]:
        """The run's measured costs (the keys of `report.COST_KEYS`)."""
        to_train, to_rollout = self.switch_seconds["to_train"], self.switch_seconds["to_rollout"]
        train_s = sum(self.micro_seconds)
        kept = sum(s.get("trajectories", 0) for s in self.exec_stats.values())
        trained_execs = sum(1 for s in self.exec_stats.values() if s.get("trajectories", 0) > 0)
        first = min(self.start.values()) if self.start else 0.0
        return {
            **fixed,
            "switch_to_train_s": _mean(to_train, _mean(to_rollout, 1.0)),
            "switch_to_rollout_s": _mean(to_rollout, _mean(to_train, 0.5)),
            "weight_sync_s": _mean(self.update_times["publish"]),
            "migration_pause_s": _mean(self.drains),
            "optimizer_step_s": _mean(self.update_times["step"]),
            "grad_sync_s": _mean(self.update_times["grads"]),
            "micro_step_s": _mean(self.micro_seconds),
            "train_cell_s_per_trajectory": train_s / kept if kept else 0.0,
            "train_cell_s_per_execution": train_s / trained_execs if trained_execs else 0.0,
            "makespan_s": self.last_publish - first,
        }

    def trace(self, sched: Any) -> list[dict[str, Any]]:
        """One row per launched execution (the `trace.jsonl` contract), in launch order."""
        rows = []
        for e in sorted(self.start, key=lambda e: (self.start[e], e)):
            item, outcome = sched.planned[e], self.outcome.get(e)
            rows.append(
                trace_row(
                    (self.start[e], self.end.get(e, self.last_publish)),
                    item.group,
                    sched.ledger.batch_of[e],
                    item.execution_id,
                    self.version[e],
                    None if outcome is None else (outcome.timed_out, outcome.valid, outcome.reward),
                    self.exec_stats.get(item.execution_id, {}),
                    self.runner.get(e, WORKERS_NAME),
                )
            )
        return rows

    def summary(self, sched: Any, costs: dict[str, Any]) -> dict[str, Any]:
        """Everything `scheduler.run` returns: per-step metrics, trace rows, costs, utilisation."""
        now = self.last_publish
        for i in list(self._busy):
            self.spans.append((self.ids[i], "rollout", self._busy.pop(i), now))
        for i, view in enumerate(sched.views):
            kind = _PHASE_KIND.get(view.phase)
            if kind is not None:
                self.spans.append((self.ids[i], kind, view.since, now))
        first = min(self.start.values()) if self.start else 0.0
        shifted = [(c, k, lo - first, hi - first) for c, k, lo, hi in self.spans]
        share = utilisation(shifted, costs["makespan_s"])
        for cell in self.ids:
            share.setdefault(cell, {"rollout": 0.0, "training": 0.0, "switching": 0.0, "idle": 1.0})
        return {
            "steps": list(sched.step_metrics),
            "trace": self.trace(sched),
            "costs": costs,
            "utilisation": share,
            "spans": [(c, k, round(lo, 4), round(hi, 4)) for c, k, lo, hi in shifted],
            "switches": list(self.events),
            "group_processing_s": round(_mean(self.group_seconds), 4),
        }
