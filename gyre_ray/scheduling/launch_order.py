"""Sibling launch order: which pending executions of a batch to launch first, from what their task showed.

A batch's executions run one task each, 16 per task (the GSPO group), and a task's durations are
correlated (a hard task's executions all run long). When a batch cannot launch at once (its cells
are full or training) it launches over a while, and an execution launched late ends late; a long one
launched last holds its whole batch, and the batch after next, back. No online policy knows a
duration at launch, but once some of a task's executions run, the task shows itself: siblings that
ended quickly mark a short task, siblings still running after a long while a long one.

`SiblingOrder` ranks the tasks of each launchable batch by the posterior mean of their log duration
under the workload's duration model (`DurationPrior`: log D = mu + sigma (sqrt(rho) Z_task +
sqrt(1 - rho) Z_exec), capped at the timeout), given each task's ended executions (how long they
ran; a timed-out one only says "at least the timeout") and its running ones (each has run at
least its elapsed time). Within a batch, one *probe* of every task nobody has launched yet goes
first, then the other executions task by task, longest-looking task first (ties: the task with
more executions launched, then id order; means equal to 1e-6 tie, so that the order does not hang on
the last bits a CPU's SIMD paths give), so a batch's long tasks start early and its short tasks
fill the gaps. Without task ids in the state (group -1) the order stays first-in first-out.

It reads only the state (launch times, ends, task ids) and the prior's four numbers, never a
duration in advance.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gyre_ray.scheduling.state import EndedExecution, PendingExecution, SchedState

_GRID = np.linspace(-4.0, 4.0, 41)  # standard-normal task effect Z_task
_LOG_PRIOR = -0.5 * _GRID**2
# log P(N(0, 1) > x) on [-8, 8], tabulated once for np.interp
_X = np.linspace(-8.0, 8.0, 1601)
_LOG_SF = np.log(np.array([0.5 * math.erfc(x / math.sqrt(2.0)) for x in _X]))
_SCORE_DIGITS = 6  # decimals of a task's posterior mean log duration that rank it (`SiblingOrder.order`)
_CACHE_LIMIT = 100_000  # task histories whose likelihood is kept (a 48-step run has about 3,000 tasks)


@dataclass(frozen=True)
class DurationPrior:
    """The workload's duration model in seconds: log D ~ N(mu, sigma), a share rho common to a task."""

    mu_log_s: float
    sigma_log: float
    rho: float
    timeout_s: float

    def __post_init__(self) -> None:
        if not (self.sigma_log > 0 and 0 < self.rho < 1 and self.timeout_s > 0):
            raise ValueError(f"duration prior needs sigma_log > 0, 0 < rho < 1 and timeout_s > 0, got {self}")

    @classmethod
    def from_hours(
        cls, mu_log_hours: float, sigma_log_hours: float, rho: float, timeout_hours: float
    ) -> DurationPrior:
        """The prior from a model given in log hours."""
        return cls(mu_log_hours + math.log(3600.0), sigma_log_hours, rho, timeout_hours * 3600.0)

    @classmethod
    def from_model(cls, model: HoursModel) -> DurationPrior:
        """The prior from a duration model in log hours (`gyre_ray.sim.workload.DurationModel`, as a
        workload or the `scheduler` section gives it); ValueError if it is degenerate."""
        return cls.from_hours(model.mu_log_hours, model.sigma_log_hours, model.rho, model.timeout_hours)


class HoursModel(Protocol):
    """What `DurationPrior.from_model` reads: the fields of the simulator's `DurationModel`."""

    mu_log_hours: float
    sigma_log_hours: float
    rho: float
    timeout_hours: float


def log_normal_sf(x: np.ndarray) -> np.ndarray:
    """log P(N(0, 1) > x): the table inside [-8, 8], Mills' ratio asymptote above (never -inf)."""
    far = np.maximum(x, 8.0)
    tail = -0.5 * far * far - np.log(far * math.sqrt(2.0 * math.pi))
    return np.where(x > 8.0, tail, np.interp(x, _X, _LOG_SF))


class SiblingOrder:
    """Orders `state.pending` by what each task's launched executions showed (module docstring)."""

    def __init__(self, prior: DurationPrior) -> None:
        self.prior = prior
        self._task_mean = prior.mu_log_s + math.sqrt(prior.rho) * prior.sigma_log * _GRID  # log seconds
        self._exec_sd = math.sqrt(1.0 - prior.rho) * prior.sigma_log
        self._log_timeout = math.log(prior.timeout_s)
        self._ended_cache: dict[tuple[EndedExecution, ...], np.ndarray] = {}
        self._prior_mean = self._means(_LOG_PRIOR[None, :])[0]

    def order(self, state: SchedState, room: float = math.inf) -> list[PendingExecution]:
        """The launchable pending executions, batch by batch, best first (later batches omitted).

        Each batch's list is cut once its demand passes `room` (the free rollout capacity: no
        decision launches more than that), so a decision costs what it can launch, not the queue.
        """
        last = min(state.steps_total - 1, state.policy_version + state.staleness)
        by_batch = _tasks_by_batch(state, last)
        groups = [g for tasks in by_batch.values() for g in tasks if g >= 0]
        # rounded to 1e-6 (log seconds): np.exp / np.log and numpy's sums take other SIMD paths on
        # other CPUs (AVX-512 or not), whose last bits would otherwise decide the order of near ties
        scores = {
            g: round(m, _SCORE_DIGITS)
            for g, m in zip(groups, self.posterior_means(state, groups), strict=True)
        }
        ordered: list[PendingExecution] = []
        for batch in sorted(by_batch):
            tasks = by_batch[batch]
            if -1 in tasks:  # the backend does not say which task: first in, first out
                ordered.extend(_cut((item for items in tasks.values() for item in items.values()), room))
                continue
            launched = {
                g: len(state.group_running.get(g, ())) + len(state.group_ended.get(g, ())) for g in tasks
            }
            probes = [next(iter(items.values())) for g, items in tasks.items() if launched[g] == 0]
            ranked = sorted(tasks, key=lambda g: (-scores[g], -launched[g], g))
            rest = (
                item
                for g in ranked
                for item in itertools.islice(tasks[g].values(), 1 if launched[g] == 0 else 0, None)
            )
            ordered.extend(_cut(itertools.chain(probes, rest), room))
        return ordered

    def posterior_means(self, state: SchedState, groups: Iterable[int]) -> list[float]:
        """Posterior mean of each task's log median duration (log seconds) given its launched executions.

        A task nobody launched has the prior mean; a task's ended executions are folded into its
        log-likelihood once per history (cached by content), its running ones at every call.
        """
        groups = list(groups)
        means = [self._prior_mean] * len(groups)
        rows: list[np.ndarray] = []
        positions: list[int] = []
        running_rows: list[int] = []
        running_logs: list[float] = []
        for position, g in enumerate(groups):
            ended = state.group_ended.get(g, ())
            running = state.group_running.get(g, {})
            if not ended and not running:
                continue
            row = len(rows)
            rows.append(self._ended_log_likelihood(tuple(ended)))
            positions.append(position)
            for launched_at in running.values():
                elapsed = state.now - launched_at
                if elapsed > 0:
                    running_rows.append(row)
                    running_logs.append(math.log(elapsed))
        if not rows:
            return means
        ll = np.array(rows)
        if running_rows:
            z = (np.asarray(running_logs)[:, None] - self._task_mean[None, :]) / self._exec_sd
            np.add.at(ll, np.asarray(running_rows), log_normal_sf(z))
        for position, mean in zip(positions, self._means(ll), strict=True):
            means[position] = mean
        return means

    def _means(self, ll: np.ndarray) -> list[float]:
        """Posterior means, row by row (each row's sums do not depend on the other rows, so tasks
        with the same history tie exactly)."""
        weights = np.exp(ll - ll.max(axis=1, keepdims=True))
        return ((weights * self._task_mean).sum(axis=1) / weights.sum(axis=1)).tolist()

    def _ended_log_likelihood(self, ended: tuple[EndedExecution, ...]) -> np.ndarray:
        """Log prior plus the log-likelihood of a task's ended executions, over the task-effect grid."""
        cached = self._ended_cache.get(ended)
        if cached is not None:
            return cached
        dense = [math.log(e.ran_s) for e in ended if not self._censored(e) and e.ran_s > 0]
        censored = [self._log_timeout for e in ended if self._censored(e)]
        ll = _LOG_PRIOR.copy()
        if dense:
            z = (np.asarray(dense)[:, None] - self._task_mean[None, :]) / self._exec_sd
            for term in -0.5 * z * z:  # added in end order
                ll += term
        if censored:
            z = (np.asarray(censored)[:, None] - self._task_mean[None, :]) / self._exec_sd
            for term in log_normal_sf(z):
                ll += term
        if len(self._ended_cache) >= _CACHE_LIMIT:
            self._ended_cache.clear()
        self._ended_cache[ended] = ll
        return ll

    def _censored(self, ended: EndedExecution) -> bool:
        return ended.timed_out or ended.ran_s >= self.prior.timeout_s


def _tasks_by_batch(state: SchedState, last: int) -> dict[int, dict[int, Mapping[int, PendingExecution]]]:
    """Pending executions of batches up to `last`, by batch, then task (in pending order)."""
    by_batch: dict[int, dict[int, Mapping[int, PendingExecution]]] = {}
    if state.pending_by_group:
        for g, items in state.pending_by_group.items():
            batch = next(iter(items.values())).batch
            if batch > last:
                break
            by_batch.setdefault(batch, {})[g] = items
        return by_batch
    built: dict[int, dict[int, dict[int, PendingExecution]]] = {}
    for item in state.pending:
        if item.batch > last:
            break
        built.setdefault(item.batch, {}).setdefault(item.group, {})[item.exec_id] = item
    return dict(built)


def _cut(items: Iterable[PendingExecution], room: float) -> Iterator[PendingExecution]:
    """`items` up to and including the first whose running demand passes `room`."""
    used = 0.0
    for item in items:
        yield item
        used += item.demand
        if used > room:
            return
