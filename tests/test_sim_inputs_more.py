"""`gyre-ray simulate` / `plan` on input at the edges: a workload with no work, a run folder whose costs or
trace do not add up, durations or counts past float or integer range, and plots that cannot be written.
Each ends in one line naming what to fix (exit code 2), or in a result that says what it cannot show."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from gyre_ray.cli import main
from gyre_ray.sim import runner
from gyre_ray.sim.replay import predict_run
from gyre_ray.sim.workload import TrajectoryModel, WorkloadError, trajectories_for
from tests.test_sim_cli_inputs import SMALL, one_line_error
from tests.test_sim_replay import write_run

COLOCATE = ["--cells", "2", "--steps", "2", "--policies", "colocate"]


@pytest.fixture()
def small(tmp_path: Path) -> str:
    """tests/test_sim_cli_inputs.py's small workload file."""
    (tmp_path / "small.yaml").write_text(SMALL)
    return str(tmp_path / "small.yaml")


@pytest.fixture()
def no_work(tmp_path: Path) -> str:
    """A trace of 2 steps whose 8 executions take no time and keep no trajectory: a lower bound of 0."""
    path = tmp_path / "z.jsonl"
    records = [{"start": 0, "end": 0, "task": i // 4, "step": 0, "trajectories": 0} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# 1. a lower bound of 0: no ratio to show


def test_a_workload_without_work_shows_no_ratio_to_its_bound(no_work: str, capsys) -> None:
    assert main(["simulate", "--workload", no_work, *COLOCATE]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("colocate"))
    assert row.split()[4] == "-"  # makespan, h/step, bound, x bound
    args = ["simulate", "--workload", no_work, "--cells", "2", "--steps", "2", "--json"]
    assert main([*args, "--policies", "colocate,elastic", "sim.optimizer_step_s=0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policies"]["colocate"]["ratio_to_bound"] is None
    assert report["speedups"] == {"elastic_vs_colocate": None}  # elastic took no time either


def test_a_workload_without_work_plots_without_warnings(no_work: str, tmp_path: Path, capsys) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib: "identical low and high xlims" on an axis 0 s long
        assert main(["simulate", "--workload", no_work, *COLOCATE, "--plot", str(tmp_path / "z.png")]) == 0
    assert (tmp_path / "z.png").stat().st_size > 0


def test_plan_of_a_workload_without_work_shows_no_ratio_to_its_bound(no_work: str, capsys) -> None:
    assert main(["plan", "--workload", no_work, "--nodes", "4", "--steps", "2", "--policy", "colocate"]) == 0
    captured = capsys.readouterr()
    rows = [x.split() for x in captured.out.splitlines() if x.split() and x.split()[0] == "4"]
    assert rows and all(row[4] == "-" for row in rows)  # nodes, cell nodes, cells, h/step, x bound
    assert "- x bound" in captured.err


# 2. costs.json's integers have upper limits


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"cells": 100000}, "'cells' must be <= 10,000, got 100000"),
        ({"cells": 1e20}, "'cells' must be <= 10,000, got 1e+20"),
        ({"steps": 1e30}, "'steps' must be <= 20,000,000"),
        ({"staleness": 1e30}, "'staleness' must be <= 20,000,000"),
        ({"async_train_cells": 10**12}, "'async_train_cells' must be <= 10,000"),
    ],
)
def test_costs_integers_past_their_limit_are_refused(
    tmp_path: Path, changes: dict, named: str, capsys
) -> None:
    run = write_run(tmp_path / "run", 200.0, **changes)
    assert main(["simulate", "--trace", str(run)]) == 2
    one_line_error(capsys, "costs.json", named)


# 3. a trace that does not hold the run costs.json describes


def _keep_lines(run: Path, keep) -> None:
    lines = (run / "trace.jsonl").read_text().splitlines()
    (run / "trace.jsonl").write_text("".join(line + "\n" for i, line in enumerate(lines) if keep(i, line)))


def test_a_trace_cut_short_is_refused(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", 200.0)  # 3 steps x 4 executions
    _keep_lines(run, lambda i, _: i < 8)  # the last step lost
    assert main(["simulate", "--trace", str(run)]) == 2
    one_line_error(capsys, "holds 2 recorded step(s) (steps 0 .. 1)", "costs.json says steps = 3")
    run = write_run(tmp_path / "run2", 200.0)
    _keep_lines(run, lambda i, _: i != 11)  # one execution of the last step lost
    with pytest.raises(WorkloadError, match=r"executions_per_step = 4 executions \(step 2: 3\)"):
        predict_run(run)


def test_a_trace_without_steps_must_hold_one_step(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 200.0)
    rows = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    (run / "trace.jsonl").write_text("".join(json.dumps({**r, "step": None}) + "\n" for r in rows))
    with pytest.raises(
        WorkloadError, match="holds 12 executions where costs.json says executions_per_step = 4"
    ):
        predict_run(run)
    (run / "trace.jsonl").write_text("".join(json.dumps({**r, "step": None}) + "\n" for r in rows[:4]))
    assert predict_run(run)["steps"] == 3  # one step replayed at every step, as documented


def test_a_real_runs_trace_with_restarted_and_dropped_executions_replays(tmp_path: Path) -> None:
    """One row per planned execution, whatever became of it: started again (`r1.<id>`), dropped."""
    run = write_run(tmp_path / "run", 200.0)
    rows = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    rows[1] = {**rows[1], "exec_id": "r1." + rows[1]["exec_id"], "runner": "runner-1"}
    rows[5] = {**rows[5], "dropped": True, "trajectories": 0, "reward": None}
    (run / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert predict_run(run)["policies"]["colocate"]["predicted_over_measured"] > 0


# 4. plots that cannot be written fail in one line


def test_a_plot_in_a_folder_that_takes_no_file_is_refused_before_simulating(small: str, capsys) -> None:
    assert main(["simulate", "--workload", small, *COLOCATE, "--plot", "/proc/a.png"]) == 2
    one_line_error(capsys, "--plot /proc/a.png: cannot write there")


def test_plot_hours_past_float_range_in_seconds_are_refused(small: str, tmp_path: Path, capsys) -> None:
    args = ["--plot", str(tmp_path / "a.png"), "--plot-hours", "1e308"]
    assert main(["simulate", "--workload", small, *COLOCATE, *args]) == 2
    one_line_error(capsys, "need --plot-hours <= 1,000,000, got 1e+308")
    assert not (tmp_path / "a.png").exists()


def test_a_plot_that_fails_after_the_simulation_is_one_line(
    small: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gyre_ray.sim.plot.plot_timelines", full_disk)
    assert (
        main(["simulate", "--workload", small, *COLOCATE, "--json", "--plot", str(tmp_path / "a.png")]) == 2
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["policies"]["colocate"]["makespan_s"] > 0  # the table stands
    err = [x for x in captured.err.splitlines() if "--plot" in x]
    assert err == [
        f"gyre-ray simulate: --plot {tmp_path / 'a.png'}: cannot write the plot (No space left on device)"
    ]
    assert not (tmp_path / "a.png").exists()  # the check before the simulation left nothing behind


# 5. / 6. trajectories: a tiny tau or a huge budget


def test_a_tiny_tau_keeps_the_budget_and_never_overflows() -> None:
    k = trajectories_for(np.array([0.0, 1.0, 3600.0, 1e9]), TrajectoryModel(tau_hours=1e-20, budget=5))
    assert k.tolist() == [1, 5, 5, 5]
    k = trajectories_for(np.array([0.0, 1e9]), TrajectoryModel(tau_hours=1e-300, budget=5))
    assert k.tolist() == [1, 5]


def test_a_tiny_tau_gives_a_positive_bound(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tau.yaml"
    path.write_text(SMALL + "trajectories: {tau_hours: 1e-20}\n")
    assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["policies"]["colocate"]
    assert row["lower_bound_s"] > 0 and row["makespan_s"] >= row["lower_bound_s"]


def test_a_budget_past_its_limit_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "budget.yaml"
    path.write_text(SMALL + f"trajectories: {{budget: {10**30}}}\n")
    assert main(["simulate", "--workload", str(path), *COLOCATE]) == 2
    one_line_error(capsys, "trajectories.budget: Input should be less than or equal to 1000000")


# 7. durations past float range


def test_a_trace_duration_past_float_range_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "inf.jsonl"
    path.write_text('{"start": -1e308, "end": 1e308}\n')
    assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 2
    one_line_error(capsys, "inf.jsonl:1: execution lasts inf s (end - start)", "at most 3.6e+09 s")


def test_a_timeout_past_its_limit_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "long.yaml"
    path.write_text(SMALL + "duration: {mu_log_hours: 800, timeout_hours: 1.0e+306}\n")
    assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 2
    one_line_error(capsys, "duration.timeout_hours: Input should be less than or equal to 1000000")


def test_durations_beyond_float_range_end_at_the_timeout_without_warnings(tmp_path: Path, capsys) -> None:
    path = tmp_path / "long.yaml"
    path.write_text(SMALL + "duration: {mu_log_hours: 800, timeout_hours: 2.0}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's "overflow encountered in exp"
        assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["policies"]["colocate"]
    assert row["makespan_s"] >= 2 * 2 * 3600  # two steps of executions that all time out at 2 h


def test_costs_that_sum_past_float_range_fail_in_one_line(small: str, capsys) -> None:
    assert main(["simulate", "--workload", small, *COLOCATE, "--json", "sim.optimizer_step_s=1e308"]) == 1
    one_line_error(capsys, "simulation failed: colocate: makespan inf s, bound inf s: not finite")


# 8. / 9. the micro-step: 0 for a run that trained nothing, else at least 1 ms


def test_a_run_that_trained_nothing_replays(tmp_path: Path) -> None:
    untrained = {"micro_step_s": 0.0, "train_cell_s_per_trajectory": 0.0, "train_cell_s_per_execution": 0.0}
    run = write_run(tmp_path / "run", 200.0, **untrained)
    rows = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    (run / "trace.jsonl").write_text("".join(json.dumps({**r, "trajectories": 0}) + "\n" for r in rows))
    row = predict_run(run)["policies"]["colocate"]
    assert row["predicted_makespan_s"] > 0 and row["switches"] == 0  # no step had anything to train


def test_a_micro_step_of_0_with_training_work_is_refused(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", 200.0, micro_step_s=0.0)
    assert main(["simulate", "--trace", str(run)]) == 2
    one_line_error(capsys, "'micro_step_s' is 0", "the run has training work", ">= 0.001 s")


def test_a_micro_step_under_a_millisecond_is_refused(small: str, tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", 200.0, micro_step_s=1e-9)
    assert main(["simulate", "--trace", str(run)]) == 2
    one_line_error(capsys, "'micro_step_s' must be >= 0.001 s", "got 1e-09")
    assert main(["simulate", "--workload", small, *COLOCATE, "sim.micro_step_s=1e-9"]) == 2
    assert "sim.micro_step_s: Input should be greater than or equal to 0.001" in capsys.readouterr().err


# 10. --jobs: no more processes than candidates


def test_no_more_processes_than_candidates(monkeypatch) -> None:
    asked: list[int] = []

    def no_pool(jobs: int):
        asked.append(jobs)
        raise OSError("no pool in this test")

    monkeypatch.setattr(runner, "_pool", no_pool)
    from gyre_ray.sim.presets import PRESETS
    from gyre_ray.sim.workload import sample_workload

    spec = PRESETS["nl2repo"].model_copy(update={"tasks_per_step": 2, "group_size": 2})
    wl = sample_workload(spec, 1)
    candidates = {"eager": {"prefetch": "eager"}, "spare": {"prefetch": "spare"}}
    runs = runner._run_candidates(wl, 2, 1, None, False, candidates, 16, None)
    assert asked == [2] and set(runs) == {"eager", "spare"}


# 11. a CSV with a BOM, a step that is no integer, demand_sigma's limit


def test_a_csv_trace_with_a_bom_is_read(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfstart,end\n0,10\n0,20\n")
    assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["colocate"]["makespan_s"] > 20


@pytest.mark.parametrize("step", ["1.7", "true", '"x"'])
def test_a_step_that_is_no_integer_is_refused(tmp_path: Path, step: str, capsys) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text(f'{{"start": 0, "end": 10, "step": 0}}\n{{"start": 0, "end": 10, "step": {step}}}\n')
    assert main(["simulate", "--workload", str(path), *COLOCATE]) == 2
    one_line_error(capsys, "steps.jsonl:2: field 'step' must be an integer, got")


def test_an_integral_step_number_is_taken(tmp_path: Path, capsys) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text('{"start": 0, "end": 10, "step": 0.0}\n{"start": 0, "end": 10, "step": "1"}\n')
    assert main(["simulate", "--workload", str(path), *COLOCATE, "--json"]) == 0


def test_demand_sigma_past_its_limit_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "sigma.yaml"
    path.write_text(SMALL + "demand_sigma: 40\n")
    assert main(["simulate", "--workload", str(path), *COLOCATE]) == 2
    one_line_error(capsys, "demand_sigma: Input should be less than or equal to 3")
