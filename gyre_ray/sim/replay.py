"""Replay a real training run in the simulator: `gyre-ray simulate --trace RUN_DIR`.

A run folder holds `trace.jsonl` (one execution per line: `start`, `end`, `task`, `step`,
`timed_out`, and the runtime's extra keys) and `costs.json` (the run's measured costs; format in
docs/scheduling.md). The replay keeps the run's durations per step, its group size, capacity and
measured costs, and simulates its policy (or another one) to predict the makespan, which is shown
next to the measured one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.scheduling.duration_fit import FittedDurationModel, fit_duration_model
from gyre_ray.scheduling.runtime import policy_knobs
from gyre_ray.sim.cli import MAX_CELLS
from gyre_ray.sim.config import MIN_MICRO_STEP_S
from gyre_ray.sim.engine import SimCosts
from gyre_ray.sim.workload import (
    MAX_EXECUTIONS,
    SampledWorkload,
    WorkloadError,
    sample_workload,
    spec_from_dict,
)

TRACE_FILE, COSTS_FILE, CONFIG_FILE = "trace.jsonl", "costs.json", "config.json"
DURATION_PRIOR_KEYS = ("mu_log_hours", "sigma_log_hours", "rho", "timeout_hours")  # the override's
INT_KEYS = ("cells", "group_size", "executions_per_step", "steps", "staleness")
# the most each integer may be: the cells `--cells` takes; the others what one simulation samples
INT_LIMITS = {"cells": MAX_CELLS, "async_train_cells": MAX_CELLS} | {
    k: MAX_EXECUTIONS for k in INT_KEYS if k != "cells"
}
COST_NUMBERS = (  # measured costs in costs.json (the runtime writes them: runtime/report.py)
    "capacity_per_cell",
    "switch_to_train_s",
    "switch_to_rollout_s",
    "weight_sync_s",
    "migration_pause_s",
    "optimizer_step_s",
    "grad_sync_s",
    "micro_step_s",
    "train_cell_s_per_trajectory",
    "train_cell_s_per_execution",
    "makespan_s",
)
_POLICIES = ("colocate", "async", "elastic")


@dataclass(frozen=True)
class RunCosts:
    """The validated `costs.json` of a run."""

    cells: int
    group_size: int
    executions_per_step: int
    steps: int
    policy: str
    staleness: int
    async_train_cells: int | None
    capacity_per_cell: float
    sim: SimCosts
    train_cell_s_per_trajectory: float
    train_cell_s_per_execution: float
    makespan_s: float


def read_costs(path: Path) -> RunCosts:
    """Parse and check `costs.json`; every problem is a one-line `WorkloadError` naming the key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WorkloadError(f"{path} not found (a run folder needs {TRACE_FILE} and {COSTS_FILE})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"{path}: must hold one JSON object")
    missing = [k for k in (*INT_KEYS, *COST_NUMBERS, "policy") if k not in data]
    if missing:
        raise WorkloadError(f"{path}: missing key(s) {', '.join(missing)}")
    ints = {k: _number(data[k], k, path, integer=True) for k in INT_KEYS}
    costs = {k: _number(data[k], k, path) for k in COST_NUMBERS}
    for key in ("cells", "group_size", "executions_per_step", "steps"):
        if ints[key] < 1:
            raise WorkloadError(f"{path}: {key!r} must be >= 1, got {ints[key]}")
    for key, value in ints.items():
        if value > INT_LIMITS[key]:
            raise WorkloadError(f"{path}: {key!r} must be <= {INT_LIMITS[key]:,}, got {data[key]!r}")
    if ints["executions_per_step"] % ints["group_size"]:
        raise WorkloadError(
            f"{path}: 'executions_per_step' ({ints['executions_per_step']}) is not a multiple of "
            f"'group_size' ({ints['group_size']})"
        )
    if costs["capacity_per_cell"] <= 0:
        raise WorkloadError(f"{path}: 'capacity_per_cell' must be > 0, got {costs['capacity_per_cell']:g}")
    if 0 < costs["micro_step_s"] < MIN_MICRO_STEP_S:  # 0: the run trained nothing (`replay_costs`)
        raise WorkloadError(
            f"{path}: 'micro_step_s' must be >= {MIN_MICRO_STEP_S:g} s (the simulator's shortest micro-step), "
            f"or 0 for a run that trained nothing; got {costs['micro_step_s']:g}"
        )
    if data["policy"] not in _POLICIES:
        raise WorkloadError(f"{path}: 'policy' must be one of {', '.join(_POLICIES)}, got {data['policy']!r}")
    split = data.get("async_train_cells")
    split = None if split is None else _number(split, "async_train_cells", path, integer=True)
    if split is not None and split > INT_LIMITS["async_train_cells"]:
        raise WorkloadError(
            f"{path}: 'async_train_cells' must be <= {INT_LIMITS['async_train_cells']:,}, "
            f"got {data['async_train_cells']!r}"
        )
    sim = SimCosts(
        **{k: costs[k] for k in COST_NUMBERS if k in SimCosts.__dataclass_fields__},
    )
    return RunCosts(
        cells=ints["cells"],
        group_size=ints["group_size"],
        executions_per_step=ints["executions_per_step"],
        steps=ints["steps"],
        policy=data["policy"],
        staleness=ints["staleness"],
        async_train_cells=split or None,
        capacity_per_cell=costs["capacity_per_cell"],
        sim=sim,
        train_cell_s_per_trajectory=costs["train_cell_s_per_trajectory"],
        train_cell_s_per_execution=costs["train_cell_s_per_execution"],
        makespan_s=costs["makespan_s"],
    )


def _number(value: Any, key: str, path: Path, integer: bool = False) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer and float(value) != int(value):
        ok = False
    if not ok or value < 0:
        kind = "an integer >= 0" if integer else "a finite number >= 0"
        raise WorkloadError(f"{path}: {key!r} must be {kind}, got {value!r}")
    return int(value) if integer else float(value)


def check_run_dir(run_dir: Path) -> None:
    """`WorkloadError` unless `run_dir` is a folder holding `trace.jsonl` and `costs.json` (saying which lacks)."""
    if not run_dir.is_dir():
        raise WorkloadError(
            f"{run_dir} is not a folder (expected a run folder with {TRACE_FILE} and {COSTS_FILE})"
        )
    for name in (TRACE_FILE, COSTS_FILE):
        if (run_dir / name).is_dir():
            raise WorkloadError(f"{run_dir / name} is a folder, not the run's {name}")
    missing = [name for name in (TRACE_FILE, COSTS_FILE) if not (run_dir / name).is_file()]
    if missing:
        raise WorkloadError(
            f"{run_dir} holds no {' nor '.join(missing)} (a run writes {TRACE_FILE} and {COSTS_FILE} when "
            "it ends; one still running or stopped early lacks them)"
        )


def run_workload(run_dir: Path, cells: int, costs: RunCosts) -> SampledWorkload:
    """The run's recorded executions as a workload of `costs.steps` steps on `cells` cells.

    Training work per kept trajectory is the measured cell-seconds on the run's own cells, turned
    into cluster-seconds (the simulator's unit), so a replay on another cell count keeps the device
    budget. A trace without `trajectories` counts each execution once at `train_cell_s_per_execution`.
    `WorkloadError` when the trace does not hold the run `costs` describe (`check_trace_steps`).
    """
    trace = run_dir / TRACE_FILE
    if not trace.is_file():
        raise WorkloadError(f"{trace} not found (a run folder needs {TRACE_FILE} and {COSTS_FILE})")
    from gyre_ray.sim.traces import read_trace

    records = read_trace(trace)
    check_trace_steps(trace, records, costs)
    counted = records[0]["trajectories"] is not None  # on every record or none
    per_unit = costs.train_cell_s_per_trajectory if counted else costs.train_cell_s_per_execution
    per_trajectory = per_unit / costs.cells
    spec = spec_from_dict(
        {
            "extends": "nl2repo",
            "name": run_dir.name or "run",
            "source": f"recorded run {run_dir}",
            "trace": str(trace.resolve()),
            "tasks_per_step": costs.executions_per_step // costs.group_size,
            "group_size": costs.group_size,
            "train_cluster_s_per_trajectory": max(per_trajectory, 1e-9),
            "capacity_executions": costs.capacity_per_cell * costs.cells,
            "trajectories": {"tau_hours": 1e9, "budget": 1},  # K = 1 where the trace has no count
        },
        str(trace),
    )
    wl = sample_workload(spec, costs.steps)
    if cells != costs.cells and wl.capacity_per_cell(cells) < 1:
        raise WorkloadError(f"{cells} cells leave under one execution of capacity per cell")
    return wl


def check_trace_steps(trace: Path, records: list[dict[str, Any]], costs: RunCosts) -> None:
    """`WorkloadError` unless the trace holds the run `costs.json` describes: `steps` recorded steps of
    `executions_per_step` executions each (a real run writes one row per planned execution: a dropped
    one, one started again as `r1.<id>` and, after a resume, the earlier segments' included). A trace
    without `step` is one step, replayed at every step, so it must hold one step's executions."""
    per_step = costs.executions_per_step
    why = "a trace cut short or of another run cannot predict the measured makespan"
    if records[0]["step"] is None:
        if len(records) != per_step:
            raise WorkloadError(
                f"{trace}: its records have no 'step', so it is one step replayed at every step, but it holds "
                f"{len(records)} executions where {COSTS_FILE} says executions_per_step = {per_step}; "
                "give each record its 'step'"
            )
        return
    counts = Counter(r["step"] for r in records)
    if len(counts) != costs.steps:
        raise WorkloadError(
            f"{trace}: holds {len(counts)} recorded step(s) ({_step_span(counts)}) where {COSTS_FILE} says "
            f"steps = {costs.steps}; {why}"
        )
    wrong = sorted(step for step, n in counts.items() if n != per_step)
    if wrong:
        listed = ", ".join(f"step {s}: {counts[s]}" for s in wrong[:3]) + (", ..." if len(wrong) > 3 else "")
        raise WorkloadError(
            f"{trace}: {len(wrong)} recorded step(s) hold other than {COSTS_FILE}'s executions_per_step = "
            f"{per_step} executions ({listed}); {why}"
        )


def _step_span(counts: Counter) -> str:
    """`steps 0 .. 4` (or `step 3`) of a trace's recorded steps."""
    low, high = min(counts), max(counts)
    return f"step {low}" if low == high else f"steps {low} .. {high}"


def replay_costs(costs: RunCosts, wl: SampledWorkload, path: Path) -> SimCosts:
    """The costs a replay simulates: the run's, with the default micro-step where the run measured none
    (`micro_step_s` 0: no micro-step ran, as in a run that trained nothing: no trajectory kept, or no
    training time measured); `WorkloadError` naming `path` when the run has training work."""
    if costs.sim.micro_step_s > 0:
        return costs.sim
    measured = costs.train_cell_s_per_trajectory or costs.train_cell_s_per_execution
    if measured > 0 and wl.trajectories.sum() > 0:
        raise WorkloadError(
            f"{path}: 'micro_step_s' is 0 (no micro-step measured) but the run has training work (trajectories "
            f"kept, train_cell_s_per_* > 0); give the run's micro-step, >= {MIN_MICRO_STEP_S:g} s"
        )
    return dataclasses.replace(costs.sim, micro_step_s=SimCosts.micro_step_s)


def run_scheduler_section(run_dir: Path) -> SchedulerSection:
    """The `scheduler` section the run used (the `scheduler` of its `config.json`); the defaults when the
    folder has no config.json (a trace written by hand). `WorkloadError` naming the file if it is bad."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return SchedulerSection()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        section = data.get("scheduler", {}) if isinstance(data, dict) else None
        if not isinstance(section, dict):
            raise WorkloadError(f"{path}: 'scheduler' must be a mapping; give --config")
        return SchedulerSection.model_validate(section)
    except ValidationError as exc:
        reason = _section_errors(exc)
        raise WorkloadError(f"{path}: cannot read its scheduler section ({reason}); give --config") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise WorkloadError(f"{path}: cannot read its scheduler section ({reason}); give --config") from None


def _section_errors(exc: ValidationError) -> str:
    """Every problem of a `scheduler` section on one line, by dotted key, as config errors name them."""
    problems = []
    for item in exc.errors():
        key = ".".join(["scheduler", *(str(part) for part in item["loc"])])
        if item["type"] == "extra_forbidden":
            problems.append(
                f"{key}: unknown key; allowed here: {', '.join(sorted(SchedulerSection.model_fields))}"
            )
        else:
            problems.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
    return "; ".join(problems)


def predict_run(
    run_dir: Path,
    cells: int | None = None,
    staleness: int | None = None,
    policies: list[str] | None = None,
    async_train_cells: int | None = None,
    scheduler: SchedulerSection | None = None,
) -> dict[str, Any]:
    """Simulate the recorded run (its cells, policy, staleness and split unless given) and compare.

    `scheduler`: the section whose knobs the simulated policies take (elastic's prefetch, pace,
    repay factor and launch order; async's split unless `async_train_cells` or the run's costs give
    one); default: the run's own (`run_scheduler_section`). Each policy is built from it as the
    runtime builds it (`policy_knobs`); a sibling order with `elastic_duration_prior: auto` takes the
    model fitted to the whole trace (the run refitted it at each step's end from what had ended).

    Returns `{"run_dir", "cells", "steps", "staleness", "measured_makespan_s", "policies": {NAME:
    {"predicted_makespan_s", "predicted_over_measured", "lower_bound_s", "switches", "knobs"}},
    "duration_model"}`; the ratio is only given for the policy the run used at its own cell count
    and staleness. `duration_model` is the duration model fitted to the trace, as
    `scheduler.elastic_duration_prior` takes it (with `executions`, `tasks`, `timed_out`), or
    `{"error": why}` when the trace cannot identify one.
    """
    from gyre_ray.sim.runner import run_policy

    check_run_dir(run_dir)
    if cells is not None and cells < 1:
        raise WorkloadError(f"cells must be >= 1, got {cells}")
    if staleness is not None and staleness < 0:
        raise WorkloadError(f"staleness must be >= 0, got {staleness}")
    costs = read_costs(run_dir / COSTS_FILE)
    section = scheduler if scheduler is not None else run_scheduler_section(run_dir)
    cells = costs.cells if cells is None else cells
    staleness = costs.staleness if staleness is None else staleness
    policies = policies or [costs.policy]
    split = async_train_cells or costs.async_train_cells or section.async_split(cells)
    if "async" in policies:
        if cells < 2:
            raise WorkloadError(
                f"async needs at least 2 cells (one trainer and one rollout cell); the replay has {cells} "
                "(give --cells >= 2)"
            )
        if split >= cells:
            from_costs = not async_train_cells and costs.async_train_cells
            origin = f"{COSTS_FILE} async_train_cells" if from_costs else "scheduler.async_train_cells"
            raise WorkloadError(
                f"async: {origin} = {split} trainers leave no rollout cell among {cells} cells; "
                f"give --cells > {split} or scheduler.async_train_cells=K with K < {cells}"
            )
    wl = run_workload(run_dir, cells, costs)
    sim_costs = replay_costs(costs, wl, run_dir / COSTS_FILE)
    fit = _fit(wl)
    fitted_prior = None if isinstance(fit, str) else fit.prior()
    same_run = cells == costs.cells and staleness == costs.staleness
    rows = {}
    for name in policies:
        if name not in _POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(_POLICIES)}")
        as_run = section.model_copy(update={"policy": name, "async_train_cells": split})
        policy, knobs = policy_knobs(as_run, cells, fitted_prior)
        result = run_policy(wl, policy, cells, staleness, sim_costs, **knobs)
        row = {
            "predicted_makespan_s": round(result.makespan_s, 3),
            "lower_bound_s": round(result.lower_bound_s, 3),
            "switches": result.switches,
            "knobs": result.knobs,
        }
        if same_run and name == costs.policy and costs.makespan_s > 0:
            row["predicted_over_measured"] = round(result.makespan_s / costs.makespan_s, 4)
        rows[name] = row
    return {
        "run_dir": str(run_dir),
        "recorded_policy": costs.policy,
        "cells": cells,
        "steps": costs.steps,
        "staleness": staleness,
        "measured_makespan_s": costs.makespan_s,
        "policies": rows,
        "duration_model": {"error": fit} if isinstance(fit, str) else fit.summary(),
    }


def _fit(wl: SampledWorkload) -> FittedDurationModel | str:
    """The duration model fitted to a recorded workload, or why the trace cannot identify one."""
    try:
        return fit_duration_model(wl.duration_s, wl.group, wl.timed_out)
    except ValueError as exc:
        return str(exc)


def format_prediction(report: dict[str, Any]) -> str:
    """Plain-text lines of `predict_run`'s report."""
    lines = [
        f"run {report['run_dir']}: {report['recorded_policy']}, {report['steps']} steps, replayed on "
        f"{report['cells']} cells at eta = {report['staleness']}; measured makespan "
        f"{report['measured_makespan_s']:.1f} s",
        f"{'policy':10s} {'predicted s':>12s} {'bound s':>10s} {'switches':>8s} {'predicted/measured':>19s}",
    ]
    for name, row in report["policies"].items():
        ratio = row.get("predicted_over_measured")
        lines.append(
            f"{name:10s} {row['predicted_makespan_s']:12.1f} {row['lower_bound_s']:10.1f} {row['switches']:8d} "
            f"{'' if ratio is None else f'{ratio:.3f}':>19s}"
        )
    model = report.get("duration_model") or {}
    if "error" in model:
        lines.append(f"duration model: not fitted ({model['error']})")
    elif model:
        fields = ", ".join(f"{key}: {model[key]:g}" for key in DURATION_PRIOR_KEYS)
        lines.append(
            f"duration model fitted to the trace ({model['executions']} executions, {model['tasks']} tasks, "
            f"{model['timed_out']} timed out); for the sibling launch order: "
            f"scheduler.elastic_launch_order=sibling 'scheduler.elastic_duration_prior={{{fields}}}'"
            + (
                " (rho near 0: a task's executions say little of each other, so that order gains little)"
                if model["rho"] < 0.05
                else ""
            )
        )
    return "\n".join(lines)
