"""Run policies on one sampled workload and attach the lower bound: what `simulate`, `plan` and the benchmark share.

With `tune=True` each policy gets its best knob on the very workload it is measured on:
`async` its best fixed split (every split 1 .. C-1 trainers is simulated; one is cut short only
once its clock passes the best makespan found so far, so it could not have won), `elastic` its best
prefetch setting (eager, spare, trickle, and paced at 1 and 1.5 x the workload's longest
execution; they differ only when eta >= 1), and where the workload has a duration model, trickle
and paced at 1 x again with the sibling launch order (`SIBLING_MODES`), `jobs` candidates at a time in
processes of their own. The sweeps are returned in `knobs`. Each policy's
bound uses the staleness it may exploit: colocate is on-policy whatever eta is, so its bound uses
eta = 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import multiprocessing
import signal
import time
from collections.abc import Callable
from typing import Any

from gyre_ray.scheduling.base import make_policy, policy_names
from gyre_ray.scheduling.elastic import PREFETCH_MODES
from gyre_ray.scheduling.launch_order import DurationPrior
from gyre_ray.sim.bound import lower_bound
from gyre_ray.sim.config import SimSection
from gyre_ray.sim.engine import SimCosts, SimulationError, Simulator
from gyre_ray.sim.timeline import SimResult
from gyre_ray.sim.workload import SampledWorkload


def costs_from(section: SimSection) -> SimCosts:
    """The simulator's cost model from the `sim` config section."""
    return SimCosts(
        switch_to_train_s=section.switch_to_train_s,
        switch_to_rollout_s=section.switch_to_rollout_s,
        weight_sync_s=section.weight_sync_s,
        migration_pause_s=section.migration_pause_s,
        optimizer_step_s=section.optimizer_step_s,
        grad_sync_s=section.grad_sync_s,
        micro_step_s=section.micro_step_s,
    )


def effective_staleness(policy: str, staleness: int) -> int:
    """The staleness a policy can exploit: colocate is always on-policy."""
    return 0 if policy == "colocate" else staleness


def run_policy(
    wl: SampledWorkload,
    policy: str,
    n_cells: int,
    staleness: int,
    costs: SimCosts | None = None,
    record: bool = False,
    label: str = "",
    **knobs: Any,
) -> SimResult:
    """Simulate one policy (with its knobs) and fill in its lower bound."""
    result = _run(wl, policy, n_cells, staleness, costs, record, label, math.inf, knobs)
    assert result is not None
    return result


def _run(
    wl: SampledWorkload,
    policy: str,
    n_cells: int,
    staleness: int,
    costs: SimCosts | None,
    record: bool,
    label: str,
    give_up_after_s: float,
    knobs: dict,
) -> SimResult | None:
    costs = costs or SimCosts()
    eta = effective_staleness(policy, staleness)
    result = Simulator(wl, make_policy(policy, **knobs), n_cells, eta, costs, record).run(give_up_after_s)
    if result is None:
        return None
    result.lower_bound_s = lower_bound(wl, n_cells, eta, costs.optimizer_step_s).total_s
    if not (math.isfinite(result.makespan_s) and math.isfinite(result.lower_bound_s)):
        raise SimulationError(
            f"{policy}: makespan {result.makespan_s:g} s, bound {result.lower_bound_s:g} s: not finite; "
            "the workload's durations or the sim.* costs are too large"
        )
    result.label = label or policy
    result.knobs = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in knobs.items()}
    return result


def best_async(
    wl: SampledWorkload,
    n_cells: int,
    staleness: int,
    costs: SimCosts | None = None,
    record: bool = False,
    train_cells: int = 0,
) -> SimResult:
    """`async` with `train_cells` trainers, or (0) the best split found by simulating every one."""
    if n_cells < 2:
        raise ValueError(f"async needs at least 2 cells (one trainer, one rollout), got {n_cells}")
    if train_cells:
        return run_policy(wl, "async", n_cells, staleness, costs, record, train_cells=train_cells)
    # Try splits nearest the training share of the work first; a split is cut short (None in the
    # sweep) as soon as its clock passes the best makespan so far, since it cannot win.
    rollout_cell_s = float((wl.duration_s * wl.demand).sum()) / wl.capacity_per_cell(n_cells)
    train_cell_s = float(wl.train_cell_s(n_cells).sum())
    guess = n_cells * train_cell_s / max(rollout_cell_s + train_cell_s, 1e-9)
    sweep: dict[int, float | None] = {}
    best: SimResult | None = None
    for k in sorted(range(1, n_cells), key=lambda k: (abs(k - guess), k)):
        limit = best.makespan_s if best else math.inf
        result = _run(wl, "async", n_cells, staleness, costs, False, "", limit, {"train_cells": k})
        sweep[k] = None if result is None else round(result.makespan_s, 3)
        if result is not None and (best is None or result.makespan_s < best.makespan_s):
            best = result
    assert best is not None
    sweep = dict(sorted(sweep.items()))
    if record:
        best = run_policy(wl, "async", n_cells, staleness, costs, True, **best.knobs)
    best.knobs["sweep_makespan_s"] = sweep
    return best


def best_elastic(
    wl: SampledWorkload,
    n_cells: int,
    staleness: int,
    costs: SimCosts | None = None,
    record: bool = False,
    repay_factor: float = 1.0,
    prefetch: str | None = None,
    pace_s: float | None = None,
    sibling: bool = True,
    progress: Callable[[str], None] | None = None,
    order: dict[str, Any] | None = None,
    jobs: int = 1,
) -> SimResult:
    """`elastic` with `prefetch` as given, or (None) the fastest of its prefetch modes.

    `paced` is tried at `PACE_FACTORS` x the workload's longest execution unless `pace_s` is given;
    the modes in `SIBLING_MODES` (paced at the first pace) are tried again with the sibling launch
    order where `duration_prior` finds a model (unless `sibling` is False: a launch order given by
    the workload's ids, such as `longest_first`, is then kept). `order` (`launch_order` and
    `duration_prior` knobs) is the launch order of a `prefetch` given. `jobs` > 1 simulates the
    candidates in that many processes at once (the same result: each simulation is deterministic).
    """
    if prefetch is not None or staleness == 0:  # without prefetch the modes decide the same
        mode = prefetch or PREFETCH_MODES[0]
        knobs = {"pace_s": pace_s or _pace_grid(wl)[0]} if mode == "paced" else {}
        knobs.update(order or {})
        return run_policy(
            wl,
            "elastic",
            n_cells,
            staleness,
            costs,
            record,
            repay_factor=repay_factor,
            prefetch=mode,
            **knobs,
        )
    candidates = {
        label: {"repay_factor": repay_factor, **knobs}
        for label, knobs in elastic_candidates(wl, pace_s, sibling).items()
    }
    runs = _run_candidates(wl, n_cells, staleness, costs, record, candidates, jobs, progress)
    best = min(runs.values(), key=lambda r: r.makespan_s)  # ties: the first candidate, whatever ended first
    best.knobs["sweep_makespan_s"] = {label: round(r.makespan_s, 3) for label, r in runs.items()}
    return best


def _run_candidates(
    wl: SampledWorkload,
    n_cells: int,
    staleness: int,
    costs: SimCosts | None,
    record: bool,
    candidates: dict[str, dict[str, Any]],
    jobs: int,
    progress: Callable[[str], None] | None,
) -> dict[str, SimResult]:
    """`elastic` with each candidate's knobs, by label in candidate order; `jobs` processes at once."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    jobs = min(jobs, len(candidates))  # a process more than the candidates would only start and wait
    pool = None
    if jobs > 1 and len(candidates) > 1:
        try:
            pool = _pool(jobs)
        except OSError as exc:  # no process pool here (no shared-memory semaphores, a process limit)
            if progress is not None:
                progress(f"cannot start {jobs} processes ({exc}): the candidates run one at a time")
    order = list(candidates)
    if pool is not None:  # the sibling-order candidates take longest (tens of seconds at 48 steps)
        order.sort(key=lambda label: "launch_order" not in candidates[label])
    tasks = [(label, wl, n_cells, staleness, costs, record, candidates[label]) for label in order]
    done: dict[str, SimResult] = {}
    began = last = time.monotonic()
    results = map(_run_candidate, tasks) if pool is None else pool.imap_unordered(_run_candidate, tasks)
    try:
        for label, result in results:
            done[label] = result
            now = time.monotonic()
            if progress is not None:  # seconds this candidate took; in processes, since the search began
                progress(
                    f"elastic {label}: {result.makespan_s / 3600:.2f} h "
                    f"({len(done)}/{len(candidates)}, {now - (last if pool is None else began):.1f} s)"
                )
            last = now
    except BaseException:  # Ctrl-C or a failed simulation: the other candidates are not waited for
        if pool is not None:
            _POOLS.pop(jobs, None)
            pool.terminate()
        raise
    return {label: done[label] for label in candidates}


def _run_candidate(task: tuple) -> tuple[str, SimResult]:
    label, wl, n_cells, staleness, costs, record, knobs = task
    return label, run_policy(wl, "elastic", n_cells, staleness, costs, record, **knobs)


_POOLS: dict[int, Any] = {}


def _pool(jobs: int) -> Any:
    """The process pool of `jobs` workers (a `multiprocessing.Pool`), started on first use and kept for
    the process's life (`plan` reuses it for every layout). Spawned, not forked: the caller may hold
    threads (Ray, BLAS pools). Its workers ignore Ctrl-C: the command stops them (`terminate`)."""
    pool = _POOLS.get(jobs)
    if pool is None:
        context = multiprocessing.get_context("spawn")
        pool = _POOLS[jobs] = context.Pool(
            jobs, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
        )
    return pool


@atexit.register
def _close_pools() -> None:
    """Stop the pools' workers as the process exits (they hold nothing worth waiting for)."""
    while _POOLS:
        _POOLS.popitem()[1].terminate()


def elastic_candidates(
    wl: SampledWorkload, pace_s: float | None = None, sibling: bool = True
) -> dict[str, dict[str, Any]]:
    """The settings `best_elastic` tries when no prefetch mode is given, by label (`eager`, `spare`,
    `trickle`, `paced:<pace>`, and `<label>:sibling` for the `SIBLING_MODES`): `elastic`'s knobs."""
    candidates: dict[str, dict[str, Any]] = {
        mode: {"prefetch": mode} for mode in PREFETCH_MODES if mode != "paced"
    }
    paces = [pace_s] if pace_s else _pace_grid(wl)
    for pace in paces:
        candidates[f"paced:{pace:g}"] = {"prefetch": "paced", "pace_s": pace}
    prior = duration_prior(wl) if sibling else None
    if prior is not None:
        for label in [m if m != "paced" else f"paced:{paces[0]:g}" for m in SIBLING_MODES]:
            candidates[f"{label}:sibling"] = {
                **candidates[label],
                "launch_order": "sibling",
                "duration_prior": prior,
            }
    return candidates


PACE_FACTORS = (1.0, 1.5)
# prefetch modes `best_elastic` also tries with the sibling launch order: where it won in the
# 8-step sweep (docs/scheduling.md); with the other modes it gained at most 0.01% there
SIBLING_MODES = ("trickle", "paced")


def _launch_order(wl: SampledWorkload, launch_order: str, prior: DurationPrior | None) -> dict[str, Any]:
    """Elastic's launch-order knobs: FIFO, or the sibling order with `prior` or the workload's model."""
    if launch_order != "sibling":
        return {}
    prior = prior or duration_prior(wl)
    if prior is None:
        raise ValueError(
            "scheduler.elastic_launch_order=sibling needs a duration model: this workload has none (a trace), "
            "so give scheduler.elastic_duration_prior (mu_log_hours, sigma_log_hours, rho, timeout_hours)"
        )
    return {"launch_order": "sibling", "duration_prior": prior}


def duration_prior(wl: SampledWorkload) -> DurationPrior | None:
    """The workload's duration model as the sibling order's prior; None for a trace or a degenerate model."""
    if wl.spec.duration is None:
        return None
    try:
        return DurationPrior.from_model(wl.spec.duration)
    except ValueError:  # sigma 0 or rho 0 or 1: siblings say nothing the prior does not
        return None


def _pace_grid(wl: SampledWorkload) -> list[float]:
    """Paces `best_elastic` tries: multiples of the workload's longest execution (its timeout, in practice)."""
    longest = float(wl.duration_s.max()) if wl.n_executions else 1.0
    return [round(f * max(longest, 1.0), 3) for f in PACE_FACTORS]


def simulate(
    wl: SampledWorkload,
    policies: list[str],
    n_cells: int,
    staleness: int,
    costs: SimCosts | None = None,
    record: bool = False,
    tune: bool = True,
    async_train_cells: int = 0,
    repay_factor: float = 1.0,
    prefetch: str = "eager",
    pace_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    launch_order: str = "fifo",
    prior: DurationPrior | None = None,
    jobs: int = 1,
) -> dict[str, SimResult]:
    """Every named policy on the same workload, keyed by policy name (see the module docstring).

    `progress`, if given, gets a line after each policy and after each elastic candidate (the
    sibling-order runs take seconds to tens of seconds each at 48 steps). Without `tune`, elastic runs
    `prefetch` in `launch_order`; `sibling` takes `prior`, else the workload's own duration model.
    `jobs`: processes that simulate elastic's candidates at once (`best_elastic`)."""
    known = policy_names()
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; known: {', '.join(known)}")
    results: dict[str, SimResult] = {}
    for name in policies:
        if name == "async":
            split = 0 if tune and not async_train_cells else (async_train_cells or max(1, n_cells // 2))
            results[name] = best_async(wl, n_cells, staleness, costs, record, split)
        elif name == "elastic":
            mode = None if tune else prefetch
            order = None if tune else _launch_order(wl, launch_order, prior)
            results[name] = best_elastic(
                wl,
                n_cells,
                staleness,
                costs,
                record,
                repay_factor,
                mode,
                pace_s,
                progress=progress,
                order=order,
                jobs=jobs,
            )
        else:
            results[name] = run_policy(wl, name, n_cells, staleness, costs, record)
        if progress is not None:
            progress(f"{name}: {results[name].makespan_s / 3600:.2f} h")
    return results
