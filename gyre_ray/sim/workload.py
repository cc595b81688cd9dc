"""Workload models: what a training run asks of the cluster, step by step.

A `WorkloadSpec` describes one RL step's executions (tasks x group size), how long each runs,
how much rollout capacity it holds, and how much training its budgeted trajectory tree costs.
`sample_workload` draws `steps` batches from it (or replays a recorded trace) as flat arrays.

Duration model (see docs/scheduling.md): d = min(D, T) with
log D = mu + sigma * (sqrt(rho) Z_task + sqrt(1 - rho) Z_exec) in log hours, Z ~ N(0, 1);
with probability `runaway_fraction` an execution runs away and hits the timeout T.
Trajectories per execution: K = min(budget, 1 + floor(d / tau)).
Training work is given for the whole cluster (seconds of all cells training one trajectory), so
specs compare layouts at the same device budget: on C cells one trajectory costs C times that in
cell-seconds. Rollout capacity is also given for the whole cluster and split evenly over cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class WorkloadError(ValueError):
    """A workload file or trace is invalid; the message names the field and the limit."""


# Most executions one simulation samples (steps x tasks_per_step x group_size): 1.2 GB at peak to
# sample, and 400 x the default's 49,152 (nl2repo, 48 steps; one simulation of it takes seconds).
MAX_EXECUTIONS = 20_000_000
# Longest execution (a timeout, a recorded duration) the simulator takes: 114 years, so that sums over
# 20 million executions, their training work and every cost stay finite.
MAX_DURATION_HOURS = 1_000_000.0
# Most trajectories one execution keeps (`trajectories.budget`): a tree of paths per execution.
MAX_BUDGET = 1_000_000
# Largest log-sd of per-execution demand: at 3 the median execution already needs 1% of a unit.
MAX_DEMAND_SIGMA = 3.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DurationModel(_Strict):
    """Lognormal execution durations with a per-task correlation and a timeout cap."""

    mu_log_hours: float = Field(description="Mean of log duration (log hours).")
    sigma_log_hours: float = Field(ge=0, description="Standard deviation of log duration (log hours).")
    rho: float = Field(0.6, ge=0, le=1, description="Share of log-duration variance common to a task.")
    timeout_hours: float = Field(
        gt=0, le=MAX_DURATION_HOURS, description="Wall-clock cap T: executions end (timed out) at T."
    )
    runaway_fraction: float = Field(
        0.0, ge=0, le=1, description="Probability that an execution runs away and hits the timeout."
    )

    def share_over(self, hours: float) -> float:
        """P(d > hours) under this model (before runaways)."""
        if hours >= self.timeout_hours:
            return 0.0
        z = (math.log(hours) - self.mu_log_hours) / max(self.sigma_log_hours, 1e-12)
        return 0.5 * math.erfc(z / math.sqrt(2))


class TrajectoryModel(_Strict):
    """How many trajectories an execution's tree keeps: K = min(budget, 1 + floor(d / tau))."""

    tau_hours: float = Field(1.13, gt=0, description="Hours of execution per extra kept trajectory.")
    budget: int = Field(5, ge=1, le=MAX_BUDGET, description="Most trajectories kept per execution.")


class WorkloadSpec(_Strict):
    """One RL step's worth of executions, and how to draw or replay them."""

    name: str = Field("custom", description="Short name shown in tables.")
    description: str = Field("", description="What the workload stands for.")
    source: str = Field("", description="Where its parameters come from (paper figure, fit, trace).")
    tasks_per_step: int = Field(64, ge=1, description="Distinct tasks per step.")
    group_size: int = Field(
        16, ge=1, description="Executions per task; a group's work is queued when all end."
    )
    duration: DurationModel | None = Field(None, description="Synthetic durations (or give `trace`).")
    trace: str | None = Field(
        None, description="JSONL/CSV of recorded executions (start, end[, task, step]); replaces duration."
    )
    trajectories: TrajectoryModel = Field(default_factory=TrajectoryModel, description="Tree budget.")
    train_cluster_s_per_trajectory: float = Field(
        gt=0, description="Seconds the whole cluster needs to train one kept trajectory."
    )
    capacity_executions: float | None = Field(
        None, gt=0, description="Executions the whole cluster can host at once (default: one step's)."
    )
    demand_sigma: float = Field(
        0.0,
        ge=0,
        le=MAX_DEMAND_SIGMA,
        description="Log-sd of per-execution model demand (mean 1); 0 = every execution 1 unit.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSpec:
        if (self.duration is None) == (self.trace is None):
            raise ValueError("give exactly one of `duration` (synthetic) or `trace` (recorded run)")
        return self

    @property
    def executions_per_step(self) -> int:
        return self.tasks_per_step * self.group_size

    @property
    def cluster_capacity(self) -> float:
        """Demand units the whole cluster hosts in the rollout role."""
        return self.capacity_executions or float(self.executions_per_step)

    def capacity_origin(self) -> str:
        """Where `cluster_capacity` comes from, as the fields that set it (for error messages)."""
        if self.capacity_executions is not None:
            return f"capacity_executions {self.capacity_executions:g}"
        return (
            f"tasks_per_step {self.tasks_per_step} x group_size {self.group_size} = "
            f"{self.executions_per_step} executions, as capacity_executions is not set"
        )


@dataclass
class SampledWorkload:
    """Executions of a whole run as flat arrays (index = execution id), ordered by batch then task.

    Training work is in cluster-seconds; `train_cell_s(C)` converts it to cell-seconds on C cells.
    """

    spec: WorkloadSpec
    steps: int
    duration_s: np.ndarray  # float, per execution
    batch: np.ndarray  # int, per execution
    group: np.ndarray  # int, global group (task) id per execution
    demand: np.ndarray  # float, per execution
    trajectories: np.ndarray  # int, per execution
    timed_out: np.ndarray  # bool, per execution

    @property
    def n_executions(self) -> int:
        return int(self.duration_s.size)

    @property
    def n_groups(self) -> int:
        return int(self.group.max()) + 1 if self.group.size else 0

    def train_cell_s(self, n_cells: int) -> np.ndarray:
        """Training work of each execution in cell-seconds when the cluster is split into `n_cells`."""
        return self.trajectories * (self.spec.train_cluster_s_per_trajectory * n_cells)

    def train_cell_s_per_batch(self, n_cells: int) -> np.ndarray:
        """Training work of each batch in cell-seconds (0: every execution of advantage 0, a replayed trace)."""
        return np.bincount(self.batch, weights=self.train_cell_s(n_cells), minlength=self.steps)

    def capacity_per_cell(self, n_cells: int) -> float:
        return self.spec.cluster_capacity / n_cells


def trajectories_for(duration_s: np.ndarray, model: TrajectoryModel) -> np.ndarray:
    """K = min(budget, 1 + floor(d / tau)) for each duration (in float, then cast: a tiny tau gives the
    budget, never an integer overflow)."""
    with np.errstate(over="ignore"):  # d / tau beyond float range is inf: K is then the budget
        k = np.minimum(1.0 + np.floor(duration_s / (model.tau_hours * 3600.0)), float(model.budget))
    return k.astype(np.int64)


def sample_workload(
    spec: WorkloadSpec, steps: int, seed: int = 0, base_dir: Path | None = None
) -> SampledWorkload:
    """Draw `steps` batches from `spec` (or replay its trace, cycling its steps)."""
    if steps < 1:
        raise WorkloadError(f"steps must be >= 1, got {steps}")
    if spec.trace is None and steps * spec.executions_per_step > MAX_EXECUTIONS:
        raise WorkloadError(
            f"{steps} steps x {spec.tasks_per_step} tasks_per_step x {spec.group_size} group_size = "
            f"{steps * spec.executions_per_step:,} executions; the simulator samples at most {MAX_EXECUTIONS:,}"
        )
    rng = np.random.default_rng(seed)
    if spec.trace is not None:
        from gyre_ray.sim.traces import replay_trace

        trace_path = Path(spec.trace)
        if base_dir is not None and not trace_path.is_absolute():
            trace_path = base_dir / trace_path
        duration_s, batch, group, timed_out, kept = replay_trace(trace_path, steps, spec.group_size)
    else:
        duration_s, batch, group, timed_out = _synthetic(spec, steps, rng)
        kept = np.full(duration_s.size, -1, dtype=np.int64)
    if not np.isfinite(duration_s).all():  # the timeout and the trace reader bound them: a bug if seen
        raise WorkloadError(
            f"workload {spec.name}: an execution duration is not finite; durations must be finite seconds "
            f"(duration.timeout_hours <= {MAX_DURATION_HOURS:,.0f}, a trace's end - start likewise)"
        )
    n = duration_s.size
    if spec.demand_sigma > 0:
        s = spec.demand_sigma
        demand = np.exp(rng.normal(-0.5 * s * s, s, n))
        demand = np.minimum(demand, spec.cluster_capacity)  # one execution never outgrows the cluster
    else:
        demand = np.ones(n)
    return SampledWorkload(
        spec=spec,
        steps=steps,
        duration_s=duration_s,
        batch=batch,
        group=group,
        demand=demand,
        trajectories=kept
        if kept.size and kept.min() >= 0
        else trajectories_for(duration_s, spec.trajectories),
        timed_out=timed_out,
    )


def longest_first(wl: SampledWorkload) -> SampledWorkload:
    """The same executions with each batch's ids ordered longest first: a clairvoyant launch order.

    Policies launch pending executions in id order, so this is what a policy that knew every
    duration at launch would do with its launches; no online policy can. Group membership, demand
    and training work per execution go with it, so the lower bound is unchanged. Used by the
    benchmark (`bench_sim.py --oracle-order`) to separate what launch order costs from the rest.
    """
    order = np.lexsort((-wl.duration_s, wl.batch))
    return SampledWorkload(
        spec=wl.spec,
        steps=wl.steps,
        duration_s=wl.duration_s[order],
        batch=wl.batch[order],
        group=wl.group[order],
        demand=wl.demand[order],
        trajectories=wl.trajectories[order],
        timed_out=wl.timed_out[order],
    )


def _synthetic(spec: WorkloadSpec, steps: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    dur = spec.duration
    assert dur is not None
    g, n = spec.tasks_per_step, spec.group_size
    z_task = rng.standard_normal((steps, g, 1))
    z_exec = rng.standard_normal((steps, g, n))
    with np.errstate(over="ignore"):  # beyond float range: inf hours, capped at the timeout below
        log_h = dur.mu_log_hours + dur.sigma_log_hours * (
            math.sqrt(dur.rho) * z_task + math.sqrt(1.0 - dur.rho) * z_exec
        )
        hours = np.exp(log_h).reshape(-1)
    if dur.runaway_fraction > 0:
        runaway = rng.random(hours.size) < dur.runaway_fraction
        hours = np.where(runaway, dur.timeout_hours, hours)
    timed_out = hours >= dur.timeout_hours
    duration_s = np.minimum(hours, dur.timeout_hours) * 3600.0
    batch = np.repeat(np.arange(steps), g * n)
    group = np.repeat(np.arange(steps * g), n)
    return duration_s, batch, group, timed_out


def _format_validation(err: ValidationError, source: str) -> str:
    """One line naming every offending field: `invalid workload (SOURCE): key: problem; ...`."""
    problems = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown field")
        else:
            problems.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
    return f"invalid workload ({source}): " + "; ".join(problems)


def spec_from_dict(data: dict[str, Any], source: str = "<dict>") -> WorkloadSpec:
    """Validate a mapping as a workload; `extends: PRESET` starts from a preset and overrides fields."""
    from gyre_ray.sim.presets import PRESETS

    if not isinstance(data, dict):
        raise WorkloadError(f"workload {source} must be a mapping of fields, got {type(data).__name__}")
    data = dict(data)
    base_name = data.pop("extends", None)
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PRESETS:
            what = "unknown preset" if isinstance(base_name, str) else "must be a preset name, got"
            raise WorkloadError(
                f"workload {source}: extends: {what} {base_name!r}; known: {', '.join(PRESETS)}"
            )
        merged = PRESETS[base_name].model_dump(exclude_none=True)
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        if "trace" in data:
            merged.pop("duration", None)
        data = merged
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(_format_validation(exc, source)) from None


def load_workload(name_or_path: str) -> tuple[WorkloadSpec, Path | None]:
    """A preset by name, a workload YAML, or a bare trace (.jsonl/.csv); returns (spec, base folder)."""
    from gyre_ray.sim.presets import PRESETS

    if name_or_path in PRESETS:
        return PRESETS[name_or_path], None
    path = Path(name_or_path)
    if path.is_dir():
        hint = " (a run folder replays with `gyre-ray simulate --trace RUN_DIR`)"
        raise WorkloadError(
            f"workload {path} is a folder; give a preset ({', '.join(PRESETS)}) or a .yaml/.yml/.jsonl/.csv file"
            + (hint if (path / "trace.jsonl").is_file() else "")
        )
    if path.suffix.lower() in (".jsonl", ".csv"):
        if not path.is_file():
            raise WorkloadError(f"trace file {path} not found")
        spec = spec_from_dict(
            {"extends": "nl2repo", "name": path.stem, "trace": str(path.resolve())}, str(path)
        )
        return spec, None
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise WorkloadError(
            f"workload {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a .yaml/.yml/.jsonl/.csv file"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"workload {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise WorkloadError(f"workload {path} is not valid YAML{line}: {problem}") from None
    if data is None:
        raise WorkloadError(
            f"workload {path} is empty; give its fields (such as `extends: nl2repo`; docs/scheduling.md)"
        )
    return spec_from_dict(data, str(path)), path.parent
