"""Fitting the sibling launch order's duration model to recorded executions (`gyre_ray.scheduling.duration_fit`)."""

from __future__ import annotations

import numpy as np
import pytest

from gyre_ray.scheduling.duration_fit import fit_duration_model
from gyre_ray.scheduling.launch_order import SiblingOrder
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.workload import sample_workload


@pytest.mark.parametrize("name", ["nl2repo-hard", "terminal"])
def test_the_fit_recovers_the_model_a_workload_was_drawn_from(name: str) -> None:
    # 8 steps x 64 tasks x 16; nl2repo-hard has 38% of its executions at the 8 h timeout
    wl = sample_workload(PRESETS[name], 8, seed=0)
    true = PRESETS[name].duration
    fit = fit_duration_model(wl.duration_s, wl.group, wl.timed_out)
    assert fit.mu_log_hours == pytest.approx(true.mu_log_hours, abs=0.08)
    assert fit.sigma_log_hours == pytest.approx(true.sigma_log_hours, abs=0.06)
    assert fit.rho == pytest.approx(true.rho, abs=0.05)
    assert fit.timeout_hours == pytest.approx(true.timeout_hours)
    assert (fit.executions, fit.tasks, fit.timed_out) == (8 * 1024, 8 * 64, int(wl.timed_out.sum()))
    SiblingOrder(fit.prior())  # usable as the sibling order's prior as it stands


def test_timed_out_executions_count_as_at_least_the_timeout_not_as_ended_there() -> None:
    wl = sample_workload(PRESETS["nl2repo-hard"], 4, seed=1)
    censored = fit_duration_model(wl.duration_s, wl.group, wl.timed_out)
    as_ended = fit_duration_model(wl.duration_s, wl.group, np.zeros_like(wl.timed_out))
    true = PRESETS["nl2repo-hard"].duration
    assert abs(censored.mu_log_hours - true.mu_log_hours) < 0.15
    assert as_ended.mu_log_hours < true.mu_log_hours - 0.3  # read as a shorter, narrower workload
    assert as_ended.sigma_log_hours < true.sigma_log_hours - 0.2


def test_siblings_alike_or_unrelated_show_in_rho() -> None:
    rng = np.random.default_rng(3)
    tasks = np.repeat(np.arange(200), 8)
    shared = rng.standard_normal(200)[tasks]
    alike = np.exp(2.0 + 0.9 * shared + 0.1 * rng.standard_normal(tasks.size))
    unrelated = np.exp(2.0 + 0.9 * rng.standard_normal(tasks.size))
    no_timeout = np.zeros(tasks.size, dtype=bool)
    assert fit_duration_model(alike, tasks, no_timeout).rho > 0.95
    assert fit_duration_model(unrelated, tasks, no_timeout).rho < 0.1


@pytest.mark.parametrize(
    ("durations", "tasks", "timed_out", "message"),
    [
        ([1.0, 2.0], ["a", "a", "b"], [False, False], "differ in length"),
        ([1.0, -2.0, 3.0, 4.0], ["a", "a", "b", "b"], [False] * 4, "finite and > 0"),
        ([1.0, float("nan"), 3.0, 4.0], ["a", "a", "b", "b"], [False] * 4, "finite and > 0"),
        ([1.0, 2.0, 3.0, 4.0], ["a", "b", "c", "d"], [False] * 4, "two tasks with two or more"),
        ([9.0, 9.0, 9.0, 2.0], ["a", "a", "b", "b"], [True, True, True, False], "ended before the timeout"),
    ],
)
def test_input_that_cannot_identify_the_model_is_refused_with_the_reason(
    durations: list, tasks: list, timed_out: list, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fit_duration_model(durations, tasks, timed_out)
