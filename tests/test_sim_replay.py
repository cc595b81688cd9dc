"""`gyre-ray simulate --trace RUN_DIR`: a real run's trace and measured costs replayed (docs/scheduling.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.sim.replay import predict_run
from gyre_ray.sim.workload import WorkloadError

COSTS = {
    "cells": 2,
    "group_size": 2,
    "executions_per_step": 4,
    "steps": 3,
    "policy": "colocate",
    "staleness": 0,
    "async_train_cells": None,
    "capacity_per_cell": 2,
    "switch_to_train_s": 1.5,
    "switch_to_rollout_s": 0.5,
    "weight_sync_s": 0.25,
    "migration_pause_s": 0.25,
    "optimizer_step_s": 2.0,
    "grad_sync_s": 0.5,
    "micro_step_s": 1.0,
    "train_cell_s_per_trajectory": 3.0,
    "train_cell_s_per_execution": 4.5,
}
# per step: executions (duration s, trajectories kept); tasks t0, t1 of two executions each
STEPS = [
    [(10, 1), (14, 2), (7, 1), (9, 2)],
    [(20, 1), (5, 1), (6, 2), (6, 1)],
    [(8, 1), (8, 1), (30, 3), (4, 1)],
]


def write_run(folder: Path, makespan_s: float, **changes) -> Path:
    folder.mkdir()
    lines, t = [], 0.0
    for step, executions in enumerate(STEPS):
        for i, (duration, kept) in enumerate(executions):
            record = {
                "exec_id": f"s{step}-e{i}",
                "task": f"t{i // 2}",
                "step": step,
                "start": t,
                "end": t + duration,
                "timed_out": False,
                "calls": 3,
                "tokens": 1200,
                "trajectories": kept,
                "dropped": False,
                "version": step,
            }
            lines.append(json.dumps(record))
        t += 100.0
    (folder / "trace.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "costs.json").write_text(json.dumps({**COSTS, "makespan_s": makespan_s, **changes}))
    return folder


def colocate_by_hand() -> float:
    """Per step: last end, switch in, the kept trajectories' training on both cells, grad sync, optimizer."""
    c = COSTS
    total = 0.0
    for step in STEPS:
        work = sum(k for _, k in step) * c["train_cell_s_per_trajectory"] / c["cells"]
        total += (
            max(d for d, _ in step) + c["switch_to_train_s"] + work + c["grad_sync_s"] + c["optimizer_step_s"]
        )
    return total + (len(STEPS) - 1) * c["switch_to_rollout_s"]


def test_replay_of_a_colocate_run_predicts_its_makespan_from_trace_and_costs(tmp_path: Path) -> None:
    expected = colocate_by_hand()
    run = write_run(tmp_path / "run", makespan_s=expected * 1.1)
    report = predict_run(run)
    row = report["policies"]["colocate"]
    assert row["predicted_makespan_s"] == pytest.approx(expected, abs=1e-3)
    assert row["predicted_over_measured"] == pytest.approx(1 / 1.1, rel=1e-3)
    assert report["measured_makespan_s"] == pytest.approx(expected * 1.1)


def test_a_trace_without_kept_trajectories_trains_each_execution_at_its_measured_cost(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    lines = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    (run / "trace.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in x.items() if k != "trajectories"}) + "\n" for x in lines)
    )
    c = COSTS
    expected = (
        sum(
            max(d for d, _ in step)
            + c["switch_to_train_s"]
            + len(step) * c["train_cell_s_per_execution"] / c["cells"]
            + c["grad_sync_s"]
            + c["optimizer_step_s"]
            for step in STEPS
        )
        + (len(STEPS) - 1) * c["switch_to_rollout_s"]
    )
    assert predict_run(run)["policies"]["colocate"]["predicted_makespan_s"] == pytest.approx(
        expected, abs=1e-3
    )


def test_replay_cli_prints_predicted_and_measured_and_takes_overrides(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", makespan_s=200.0, policy="async", async_train_cells=1, staleness=1)
    assert main(["simulate", "--trace", str(run)]) == 0
    out = capsys.readouterr().out
    assert "measured makespan 200.0 s" in out and "async" in out and "predicted/measured" in out
    assert main(["simulate", "--trace", str(run), "--json", "--policies", "async,elastic"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"async", "elastic"}
    assert report["policies"]["async"]["switches"] == 0
    assert report["policies"]["async"]["knobs"] == {"train_cells": 1}
    ratio = report["policies"]["async"]["predicted_over_measured"]
    assert ratio == pytest.approx(report["policies"]["async"]["predicted_makespan_s"] / 200.0, rel=1e-3)
    assert "predicted_over_measured" not in report["policies"]["elastic"]  # not the policy that ran
    assert main(["simulate", "--trace", str(run), "--json", "--staleness", "0"]) == 0
    assert "predicted_over_measured" not in json.loads(capsys.readouterr().out)["policies"]["async"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cells": 0}, "'cells' must be >= 1"),
        ({"policy": "fifo"}, "'policy' must be one of"),
        ({"optimizer_step_s": "fast"}, "'optimizer_step_s' must be a finite number"),
        ({"executions_per_step": 5}, "not a multiple of 'group_size'"),
    ],
)
def test_bad_costs_fail_in_one_line_naming_the_key(
    tmp_path: Path, capsys, change: dict, message: str
) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0, **change)
    assert main(["simulate", "--trace", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_run_files_are_named(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    (run / "costs.json").unlink()
    assert main(["simulate", "--trace", str(run)]) == 2
    assert f"{run} holds no costs.json (a run writes trace.jsonl and costs.json when it ends" in (
        capsys.readouterr().err
    )
    (run / "trace.jsonl").unlink()
    assert main(["simulate", "--trace", str(run)]) == 2
    assert f"{run} holds no trace.jsonl nor costs.json" in capsys.readouterr().err
    (run / "trace.jsonl").mkdir()
    assert main(["simulate", "--trace", str(run)]) == 2
    assert f"{run / 'trace.jsonl'} is a folder, not the run's trace.jsonl" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "nowhere")]) == 2
    assert "nowhere is not a folder" in capsys.readouterr().err
    other = write_run(tmp_path / "other", makespan_s=100.0)
    assert main(["simulate", "--trace", str(other / "trace.jsonl")]) == 2
    assert "trace.jsonl is a file; give the run folder that holds it" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cells", "0"], "need --cells >= 1, got 0"),
        (["--cells", "-1"], "need --cells >= 1, got -1"),
        (["--cells", "20000"], "need --cells <= 10,000, got 20,000"),
        (["--staleness", "-1"], "need --staleness >= 0, got -1"),
        (["--plot-hours", "2"], "drop --workload/--steps/--seed/--plot/--plot-hours"),
    ],
)
def test_replay_flags_are_checked_like_a_plain_simulation(
    tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    assert main(["simulate", "--trace", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_predict_run_refuses_no_cells(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    with pytest.raises(WorkloadError, match="cells must be >= 1, got 0"):
        predict_run(run, cells=0)


def test_replay_fits_the_traces_duration_model_and_prints_it_as_a_config_override(
    tmp_path: Path, capsys
) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    model = predict_run(run)["duration_model"]
    assert (model["executions"], model["tasks"], model["timed_out"]) == (12, 6, 0)  # tasks per step
    assert model["timeout_hours"] == pytest.approx(30 / 3600, abs=1e-6)  # none timed out: the longest
    durations = [d for step in STEPS for d, _ in step]
    assert model["mu_log_hours"] == pytest.approx(
        sum(math.log(d / 3600) for d in durations) / len(durations), abs=0.05
    )
    assert main(["simulate", "--trace", str(run)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("duration model fitted"))
    override = line.split("'")[1]  # the line ends in: ... 'scheduler.elastic_duration_prior={...}'
    assert (
        main(
            [
                "config",
                "--config",
                "jobs/configs/toy.yaml",
                "scheduler.elastic_launch_order=sibling",
                override,
            ]
        )
        == 0
    )
    shown = json.loads(capsys.readouterr().out)["scheduler"]["elastic_duration_prior"]
    assert shown["rho"] == pytest.approx(model["rho"], abs=1e-3)
    assert shown["sigma_log_hours"] == pytest.approx(model["sigma_log_hours"], abs=1e-3)


def test_a_trace_without_siblings_says_why_no_duration_model_was_fitted(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0, group_size=1)
    lines = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    (run / "trace.jsonl").write_text(
        "".join(json.dumps({**x, "task": x["exec_id"]}) + "\n" for x in lines)  # a task per execution
    )
    assert "two tasks with two or more executions" in predict_run(run)["duration_model"]["error"]
    assert main(["simulate", "--trace", str(run)]) == 0
    assert "duration model: not fitted (need at least two tasks" in capsys.readouterr().out


def test_replay_simulates_the_scheduler_section_the_run_used(tmp_path: Path, capsys) -> None:
    """The run's config.json says trickle with the sibling order and a fitted prior (`auto`): the
    replay simulates that, with the model fitted to the trace, not the defaults (eager, first in first
    out); overrides go on top of the run's section, and --config replaces it."""
    run = write_run(tmp_path / "run", makespan_s=200.0, policy="elastic", staleness=1)
    scheduler = {"policy": "elastic", "staleness": 1, "elastic_prefetch": "trickle"}
    scheduler |= {"elastic_launch_order": "sibling", "elastic_duration_prior": "auto"}
    (run / "config.json").write_text(json.dumps({"run": {"name": "x"}, "scheduler": scheduler}))
    report = predict_run(run)
    knobs = report["policies"]["elastic"]["knobs"]
    assert (knobs["prefetch"], knobs["launch_order"]) == ("trickle", "sibling")
    fitted = report["duration_model"]
    assert knobs["duration_prior"]["rho"] == pytest.approx(fitted["rho"], abs=1e-4)  # the summary rounds
    assert knobs["duration_prior"]["timeout_s"] == pytest.approx(fitted["timeout_hours"] * 3600, rel=1e-4)
    assert "predicted_over_measured" in report["policies"]["elastic"]

    assert main(["simulate", "--trace", str(run), "--json", "scheduler.elastic_prefetch=spare"]) == 0
    knobs = json.loads(capsys.readouterr().out)["policies"]["elastic"]["knobs"]
    assert (knobs["prefetch"], knobs["launch_order"]) == ("spare", "sibling")
    assert main(["simulate", "--trace", str(run), "--json", "--config", "jobs/configs/toy.yaml"]) == 0
    knobs = json.loads(capsys.readouterr().out)["policies"]["elastic"]["knobs"]
    assert knobs["launch_order"] == "fifo" and knobs["duration_prior"] is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "config.json: cannot read its scheduler section"),
        ('{"scheduler": {"elastic_prefetch": "sideways"}}', "config.json: cannot read its scheduler section"),
        ('{"scheduler": 3}', "'scheduler' must be a mapping"),
    ],
)
def test_a_bad_run_config_fails_in_one_line_naming_it(
    tmp_path: Path, capsys, config: str, message: str
) -> None:
    run = write_run(tmp_path / "run", makespan_s=100.0)
    (run / "config.json").write_text(config)
    assert main(["simulate", "--trace", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and "give --config" in err and len(err.strip().splitlines()) == 1


def test_executions_left_untrained_for_advantage_0_add_no_training_work(tmp_path: Path) -> None:
    """A real run writes trajectories 0 for an execution of advantage 0 (not trained): the replay
    trains nothing for it; a step whose every execution is untrained costs no training at all."""

    def replay(untrained: set[tuple[str, str]], name: str) -> float:
        run = write_run(tmp_path / name, makespan_s=100.0)
        lines = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
        for x in lines:
            if (x["exec_id"].split("-")[0], x["task"]) in untrained:
                x["trajectories"] = 0
        (run / "trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return predict_run(run)["policies"]["colocate"]["predicted_makespan_s"]

    c = COSTS
    t1_of_step_0 = sum(k for _, k in STEPS[0][2:])  # task t1 of step 0: its two executions' trajectories
    saved = t1_of_step_0 * c["train_cell_s_per_trajectory"] / c["cells"]
    assert replay({("s0", "t1")}, "one-task") == pytest.approx(colocate_by_hand() - saved, abs=1e-3)
    # A step whose every execution is untrained has no training work: as in the runtime, its cells
    # never switch and its update takes no optimizer step, no gradient sync and no weight sync.
    for step in (1, 2):
        untrained = {(f"s{step}", "t0"), (f"s{step}", "t1")}
        work = sum(k for _, k in STEPS[step]) * c["train_cell_s_per_trajectory"] / c["cells"]
        skipped = work + c["switch_to_train_s"] + c["grad_sync_s"] + c["optimizer_step_s"]
        if step < len(STEPS) - 1:  # the last step has no switch back to rollout anyway
            skipped += c["switch_to_rollout_s"]
        assert replay(untrained, f"step-{step}") == pytest.approx(colocate_by_hand() - skipped, abs=1e-3)
