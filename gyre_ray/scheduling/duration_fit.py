"""Fit the sibling launch order's duration model to recorded executions (`gyre-ray simulate --trace`).

The sibling order (`gyre_ray.scheduling.launch_order`) needs the workload's duration model:
log D = mu + sigma (sqrt(rho) Z_task + sqrt(1 - rho) Z_exec) in log hours, capped at a timeout.
A user rarely knows mu, sigma and rho; a run's trace shows them. `fit_duration_model` takes each
execution's duration, its task and whether it timed out, and returns the maximum-likelihood model:

- a timed-out execution (or one that ran the timeout or longer) says only "D >= timeout" (censored),
  so a workload where many executions hit the timeout is not read as a short one;
- the task effect Z_task is integrated out per task with Gauss-Hermite quadrature, which is what
  lets rho be told apart from sigma (siblings alike: rho near 1; unrelated: near 0);
- the three parameters are found by Nelder-Mead over (mu, log sigma, logit rho), from the
  uncensored moments.

The timeout is the one given, or the median duration of the timed-out executions; with neither,
nothing is censored and the timeout is the longest duration seen (the prior's cap only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gyre_ray.scheduling.launch_order import DurationPrior, log_normal_sf

_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(24)  # for E over Z ~ N(0, 1)
_LOG_WEIGHTS = np.log(_WEIGHTS / math.sqrt(2.0 * math.pi))
_SPREAD = 1.5  # nodes spread 1.5 x a task's posterior sd
_PASSES = 2  # the second places the nodes where the first found each task's posterior
_HOUR = 3600.0
_RHO_LIMITS = (1e-3, 1.0 - 1e-3)


@dataclass(frozen=True)
class FittedDurationModel:
    """The fitted model in log hours (the fields of a workload's `duration` and of
    `scheduler.elastic_duration_prior`), and what it was fitted on."""

    mu_log_hours: float
    sigma_log_hours: float
    rho: float
    timeout_hours: float
    executions: int
    tasks: int
    timed_out: int

    def config(self) -> dict[str, float]:
        """The `scheduler.elastic_duration_prior` block (rounded to 4 decimals)."""
        return {
            "mu_log_hours": round(self.mu_log_hours, 4),
            "sigma_log_hours": round(self.sigma_log_hours, 4),
            "rho": round(self.rho, 4),
            "timeout_hours": round(self.timeout_hours, 6),
        }

    def summary(self) -> dict[str, float | int]:
        """`config()` and what the model was fitted on (`executions`, `tasks`, `timed_out`)."""
        return {
            **self.config(),
            "executions": self.executions,
            "tasks": self.tasks,
            "timed_out": self.timed_out,
        }

    def prior(self) -> DurationPrior:
        """The model as the sibling order's prior."""
        return DurationPrior.from_hours(self.mu_log_hours, self.sigma_log_hours, self.rho, self.timeout_hours)


def fit_duration_model(
    durations_s: Sequence[float] | np.ndarray,
    tasks: Sequence[object] | np.ndarray,
    timed_out: Sequence[bool] | np.ndarray,
    timeout_s: float | None = None,
) -> FittedDurationModel:
    """Maximum-likelihood duration model of executions (seconds), grouped by task (module docstring).

    ValueError, naming what is wrong, when the input cannot identify the model: lengths differ,
    a duration is not finite and positive, fewer than two tasks have two executions each (rho
    needs siblings), or fewer than two executions ended before the timeout (sigma needs them).
    """
    d = np.asarray(durations_s, dtype=float)
    censored_flags = np.asarray(timed_out, dtype=bool)
    task_list = list(tasks)
    if not (d.size == censored_flags.size == len(task_list)):
        raise ValueError(
            f"durations ({d.size}), tasks ({len(task_list)}) and timed_out ({censored_flags.size}) differ in length"
        )
    if d.size and not (np.all(np.isfinite(d)) and np.all(d > 0)):
        raise ValueError("every duration must be finite and > 0 seconds")
    timeout = _timeout_s(d, censored_flags, timeout_s)
    # without a given timeout or a timed-out execution the cap is only the longest seen: nothing censored
    cap_known = timeout_s is not None or bool(np.any(censored_flags))
    censored = censored_flags | (d >= timeout) if cap_known else censored_flags
    _, task_index = np.unique(np.asarray([str(t) for t in task_list], dtype=object), return_inverse=True)
    sizes = np.bincount(task_index)
    if int(np.sum(sizes >= 2)) < 2:
        raise ValueError(
            "need at least two tasks with two or more executions each to fit rho (the task share)"
        )
    if int(np.sum(~censored)) < 2:
        raise ValueError("need at least two executions that ended before the timeout to fit sigma")
    log_d = np.log(np.where(censored, timeout, d) / _HOUR)
    log_timeout = math.log(timeout / _HOUR)

    def negative_log_likelihood(theta: np.ndarray) -> float:
        return -_log_likelihood(theta, log_d, censored, task_index, sizes.size, log_timeout)

    dense = log_d[~censored]
    start = np.array([float(dense.mean()), math.log(max(float(dense.std()), 0.05)), 0.0])
    best = _nelder_mead(negative_log_likelihood, start)
    mu, sigma, rho = _unpack(best)
    return FittedDurationModel(
        mu_log_hours=mu,
        sigma_log_hours=sigma,
        rho=rho,
        timeout_hours=timeout / _HOUR,
        executions=int(d.size),
        tasks=int(sizes.size),
        timed_out=int(np.sum(censored)),
    )


def _timeout_s(d: np.ndarray, timed_out: np.ndarray, given: float | None) -> float:
    if given is not None:
        if not (math.isfinite(given) and given > 0):
            raise ValueError(f"timeout_s must be finite and > 0, got {given}")
        return float(given)
    if np.any(timed_out):
        return float(np.median(d[timed_out]))
    if not d.size:
        raise ValueError("no executions to fit")
    return float(d.max())


def _unpack(theta: np.ndarray) -> tuple[float, float, float]:
    low, high = _RHO_LIMITS
    rho = low + (high - low) / (1.0 + math.exp(-float(theta[2])))
    return float(theta[0]), math.exp(float(theta[1])), rho


def _log_likelihood(
    theta: np.ndarray,
    log_d: np.ndarray,
    censored: np.ndarray,
    task_index: np.ndarray,
    n_tasks: int,
    log_timeout: float,
) -> float:
    """Sum over tasks of log E_Z[prod over the task's executions of their likelihood given Z].

    Adaptive Gauss-Hermite: each task's nodes sit around its own posterior of Z, so a sharp posterior
    (rho near 1, many siblings) is integrated as accurately as a broad one. The first pass centres
    them on the normal posterior its durations give when timed-out ones are read as ending at the
    timeout; the second (the value returned) on the posterior mean and sd the first pass found.
    """
    mu, sigma, rho = _unpack(theta)
    task_sd, exec_sd = sigma * math.sqrt(rho), sigma * math.sqrt(1.0 - rho)
    counts = np.bincount(task_index, minlength=n_tasks)
    sums = np.bincount(task_index, weights=log_d - mu, minlength=n_tasks)
    precision = 1.0 + counts * (task_sd / exec_sd) ** 2
    centre = (task_sd / exec_sd**2) * sums / precision
    spread = _SPREAD / np.sqrt(precision)
    for _ in range(_PASSES):
        nodes = centre[:, None] + spread[:, None] * _NODES[None, :]  # per task
        per_task = (
            -0.5 * nodes**2 + 0.5 * _NODES[None, :] ** 2 + np.log(spread)[:, None] + _LOG_WEIGHTS[None, :]
        )
        means = mu + task_sd * nodes[task_index]  # each execution's mean log duration at its task's nodes
        z = (log_d[:, None] - means) / exec_sd
        per_exec = -0.5 * z * z - math.log(exec_sd * math.sqrt(2.0 * math.pi))
        per_exec[censored] = log_normal_sf((log_timeout - means[censored]) / exec_sd)  # "at least T"
        np.add.at(per_task, task_index, per_exec)
        top = per_task.max(axis=1, keepdims=True)
        weights = np.exp(per_task - top)
        total = weights.sum(axis=1)
        # re-centre on the posterior the nodes just saw (timed-out siblings move it off the first guess)
        centre = (weights * nodes).sum(axis=1) / total
        sd = np.sqrt(np.maximum((weights * (nodes - centre[:, None]) ** 2).sum(axis=1) / total, 1e-12))
        spread = np.maximum(_SPREAD * sd, 1e-3)
    return float(np.sum(top[:, 0] + np.log(total)))


def _nelder_mead(
    f: Callable[[np.ndarray], float], start: np.ndarray, step: float = 0.3, iterations: int = 400
) -> np.ndarray:
    """Minimise `f` from `start` (the standard reflect / expand / contract / shrink simplex)."""
    simplex = [start] + [start + step * np.eye(start.size)[i] for i in range(start.size)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < 1e-9 * (1.0 + abs(values[0])):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        f_reflected = f(reflected)
        if f_reflected < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            f_expanded = f(expanded)
            simplex[-1], values[-1] = (
                (expanded, f_expanded) if f_expanded < f_reflected else (reflected, f_reflected)
            )
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            f_contracted = f(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]
