"""`gyre-ray simulate` / `plan` input handling: bad input fails before any simulation, in one line naming
what the user gave, with exit code 2; input a command cannot honour is refused, never ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.sim.replay import predict_run
from gyre_ray.sim.workload import WorkloadError
from tests.test_sim_replay import COSTS as REPLAY_COSTS

SMALL = "extends: nl2repo\nname: small\ntasks_per_step: 4\ngroup_size: 4\n"
# the replay tests' measured costs, for a 2-step elastic run at eta 1
COSTS = {**REPLAY_COSTS, "steps": 2, "policy": "elastic", "staleness": 1, "makespan_s": 100.0}


@pytest.fixture()
def small(tmp_path: Path) -> str:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return str(path)


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    """A run folder as a run leaves it: trace.jsonl (2 steps of 2 tasks x 2 executions) and costs.json."""
    folder = tmp_path / "run"
    folder.mkdir()
    records = [
        {"task": f"t{i // 2}", "step": step, "start": 100.0 * step, "end": 100.0 * step + 5 + 3 * i}
        for step in range(2)
        for i in range(4)
    ]
    (folder / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "costs.json").write_text(json.dumps(COSTS))
    return folder


def one_line_error(capsys, *parts: str) -> str:
    """The command printed nothing on stdout and one line on stderr holding every part."""
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    for part in parts:
        assert part in captured.err
    return captured.err


# 1. --plot-hours inf


@pytest.mark.parametrize("hours", ["inf", "-inf", "nan", "0"])
def test_plot_hours_must_be_finite_and_is_checked_before_simulating(
    small: str, tmp_path: Path, hours: str, capsys
) -> None:
    args = ["simulate", "--workload", small, "--steps", "1", "--cells", "2", "--policies", "colocate"]
    assert main([*args, "--plot", str(tmp_path / "p.png"), f"--plot-hours={hours}"]) == 2
    one_line_error(capsys, f"--plot-hours must be > 0 and finite, got {float(hours)}")
    assert not (tmp_path / "p.png").exists()


# 2. dotted overrides under --trace


def test_trace_takes_scheduler_staleness_as_staleness(run: Path, capsys) -> None:
    assert main(["simulate", "--trace", str(run), "--json", "scheduler.staleness=5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["staleness"] == 5
    assert "predicted_over_measured" not in report["policies"]["elastic"]  # not the run's own eta (1)
    assert main(["simulate", "--trace", str(run), "--json", "scheduler={staleness: 3}"]) == 0
    assert json.loads(capsys.readouterr().out)["staleness"] == 3
    # --staleness wins, as it does over scheduler.staleness without --trace
    assert main(["simulate", "--trace", str(run), "--json", "--staleness", "0", "scheduler.staleness=5"]) == 0
    assert json.loads(capsys.readouterr().out)["staleness"] == 0
    assert main(["simulate", "--trace", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["staleness"] == 1  # the run's own


def test_trace_refuses_a_bad_scheduler_staleness_override(run: Path, capsys) -> None:
    assert main(["simulate", "--trace", str(run), "scheduler.staleness=-1"]) == 2
    assert "scheduler.staleness: Input should be greater than or equal to 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override",
    ["sim.workload=terminal", "sim.weight_sync_s=10", "sim.policies=[async]", "run.name=x", "sim={cells: 4}"],
)
def test_trace_refuses_overrides_it_cannot_apply(run: Path, override: str, capsys) -> None:
    assert main(["simulate", "--trace", str(run), override]) == 2
    one_line_error(
        capsys, f"--trace takes the workload, steps and costs from the run: {override} does not apply"
    )


@pytest.mark.parametrize("trace", [True, False])
def test_a_scheduler_policy_override_is_refused_for_policies(
    run: Path, small: str, trace: bool, capsys
) -> None:
    source = ["--trace", str(run)] if trace else ["--workload", small, "--steps", "1", "--cells", "2"]
    assert main(["simulate", *source, "scheduler.policy=colocate"]) == 2
    default = "the run's own" if trace else "sim.policies"
    one_line_error(
        capsys,
        f"scheduler.policy=colocate does not apply: simulate runs the policies of --policies (default "
        f"{default}); give --policies colocate",
    )


def test_trace_still_takes_scheduler_knob_overrides(run: Path, capsys) -> None:
    args = ["simulate", "--trace", str(run), "--json", "--policies", "async,elastic", "--cells", "3"]
    assert main([*args, "scheduler.async_train_cells=2", "scheduler.elastic_prefetch=spare"]) == 0
    policies = json.loads(capsys.readouterr().out)["policies"]
    assert policies["async"]["knobs"] == {"train_cells": 2}
    assert policies["elastic"]["knobs"]["prefetch"] == "spare"


# 3. plan reads a workload YAML's relative trace from the YAML's folder


def test_plan_reads_a_relative_trace_next_to_the_yaml(tmp_path: Path, monkeypatch, capsys) -> None:
    folder = tmp_path / "wl"
    folder.mkdir()
    records = [{"task": f"t{i // 2}", "step": 0, "start": 0, "end": 60 + 30 * i} for i in range(4)]
    (folder / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "reltrace.yaml").write_text("extends: nl2repo\nname: rel\ntrace: good.jsonl\ngroup_size: 2\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    workload = str(folder / "reltrace.yaml")
    assert main(["plan", "--workload", workload, "--nodes", "4", "--steps", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "rel" and report["recommended"]["4"]["makespan_s"] > 0
    assert main(["simulate", "--workload", workload, "--steps", "1", "--cells", "2", "--json"]) == 0  # alike


# 4. empty policy lists


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (["--policies", ","], "--policies ','"),
        (["--policies", ""], "--policies ''"),
        (["--policies", " , "], "--policies ' , '"),
        (["sim.policies=[]"], "sim.policies"),
    ],
)
def test_simulate_refuses_an_empty_policy_list(small: str, args: list[str], given: str, capsys) -> None:
    assert main(["simulate", "--workload", small, "--steps", "1", "--cells", "2", *args]) == 2
    one_line_error(
        capsys, f"no policy given: {given} names none; give one or more of colocate, async, elastic"
    )


@pytest.mark.parametrize("value", [",", ""])
def test_trace_refuses_an_empty_policy_list(run: Path, value: str, capsys) -> None:
    assert main(["simulate", "--trace", str(run), "--policies", value]) == 2
    one_line_error(capsys, f"no policy given: --policies {value!r} names none")


def test_plan_refuses_an_empty_policy(small: str, capsys) -> None:
    assert main(["plan", "--workload", small, "--nodes", "4", "--policy", ""]) == 2
    one_line_error(capsys, "--policy is empty; give one of colocate, async, elastic")


# 5. a bad key in the run's config.json is named


@pytest.mark.parametrize(
    ("scheduler", "named"),
    [
        ({"stalenes": 1}, "scheduler.stalenes: unknown key; allowed here: async_train_cells, "),
        ({"staleness": -2}, "scheduler.staleness: Input should be greater than or equal to 0 (got -2)"),
    ],
)
def test_a_bad_key_in_the_runs_config_is_named(run: Path, scheduler: dict, named: str, capsys) -> None:
    (run / "config.json").write_text(json.dumps({"scheduler": scheduler}))
    assert main(["simulate", "--trace", str(run)]) == 2
    err = one_line_error(capsys, f"{run / 'config.json'}: cannot read its scheduler section (", named)
    assert "validation error for" not in err


# 6. messages name what the user set


def test_an_empty_workload_file_is_called_empty(tmp_path: Path, capsys) -> None:
    for text in ("", "# nothing yet\n"):
        (tmp_path / "empty.yaml").write_text(text)
        assert main(["simulate", "--workload", str(tmp_path / "empty.yaml")]) == 2
        err = one_line_error(capsys, f"workload {tmp_path / 'empty.yaml'} is empty")
        assert "NoneType" not in err


def test_too_little_capacity_names_the_fields_that_set_it(tmp_path: Path, capsys) -> None:
    path = tmp_path / "one.yaml"
    path.write_text("extends: nl2repo\ntasks_per_step: 1\ngroup_size: 1\n")
    args = ["simulate", "--workload", str(path), "--steps", "1", "--cells", "2", "--policies", "colocate"]
    assert main(args) == 2
    err = one_line_error(
        capsys,
        "2 cells get 0.5 executions of rollout capacity each",
        "tasks_per_step 1 x group_size 1 = 1 executions, as capacity_executions is not set",
        "set capacity_executions >= 2 or use fewer cells",
    )
    assert "demand_sigma" not in err  # not set: every execution needs exactly 1
    path.write_text("extends: nl2repo\ncapacity_executions: 1\ndemand_sigma: 0.5\n")
    assert main(args) == 2
    one_line_error(capsys, "capacity_executions 1", "(demand_sigma 0.5)", "or a smaller demand_sigma")


def test_plan_blames_the_reference_nodes_for_too_little_capacity(small: str, capsys) -> None:
    args = ["plan", "--workload", small, "--nodes", "4", "--steps", "1", "--reference-nodes", "99999999999"]
    assert main(args) == 2
    err = one_line_error(
        capsys,
        "4 nodes as 4 cells get 1.6e-10 executions of rollout capacity per cell",
        "is for 99,999,999,999 reference nodes (--reference-nodes",
        "give --reference-nodes <= 16,",
    )
    assert "gyre-ray plan: 4 nodes as" in err  # before any layout was simulated (no progress line)


def test_trace_async_needs_two_cells(run: Path, tmp_path: Path, capsys) -> None:
    assert main(["simulate", "--trace", str(run), "--policies", "async", "--cells", "1"]) == 2
    err = one_line_error(capsys, "async needs --cells >= 2 (one trainer and one rollout cell)")
    assert "(1 .. 0)" not in err
    one_cell = tmp_path / "one-cell"
    one_cell.mkdir()
    (one_cell / "trace.jsonl").write_text((run / "trace.jsonl").read_text())
    (one_cell / "costs.json").write_text(json.dumps({**COSTS, "cells": 1, "capacity_per_cell": 4}))
    with pytest.raises(WorkloadError, match="async needs at least 2 cells .* the replay has 1"):
        predict_run(one_cell, policies=["async"])


def test_trace_async_split_names_where_it_comes_from(run: Path, capsys) -> None:
    assert (
        main(["simulate", "--trace", str(run), "--policies", "async", "scheduler.async_train_cells=2"]) == 2
    )
    one_line_error(
        capsys, "async: scheduler.async_train_cells = 2 trainers leave no rollout cell among 2 cells"
    )
    (run / "costs.json").write_text(json.dumps({**COSTS, "async_train_cells": 3, "cells": 4}))
    assert main(["simulate", "--trace", str(run), "--policies", "async", "--cells", "3"]) == 2
    one_line_error(
        capsys, "async: costs.json async_train_cells = 3 trainers leave no rollout cell among 3 cells"
    )


# 7. elastic's own knobs: searched by default (and said so when set), run as set without the search


def test_elastic_knobs_set_while_the_search_is_on_are_said_to_be_unused(small: str, capsys) -> None:
    argv = ["simulate", "--workload", small, "--cells", "2", "--steps", "2", "--policies", "elastic"]
    assert main([*argv, "scheduler.elastic_prefetch=spare"]) == 0
    err = capsys.readouterr().err
    assert (
        "sim.tune_knobs is on, so elastic's knobs are searched and scheduler.elastic_prefetch is not used"
        in err
    )
    assert main(argv) == 0
    assert "sim.tune_knobs is on" not in capsys.readouterr().err
    # with prefetch=paced the pace set replaces the searched pace grid: only the prefetch goes unused
    assert main([*argv, "scheduler.elastic_prefetch=paced", "scheduler.elastic_pace_s=900"]) == 0
    err = capsys.readouterr().err
    assert "searched and scheduler.elastic_prefetch is not used" in err and "elastic_pace_s" not in err
    assert main([*argv, "scheduler.elastic_prefetch=spare", "scheduler.elastic_pace_s=900"]) == 0
    assert "scheduler.elastic_prefetch, scheduler.elastic_pace_s are not used" in capsys.readouterr().err


def test_without_the_search_elastic_runs_the_launch_order_set(small: str, tmp_path: Path, capsys) -> None:
    flags = ["simulate", "--cells", "2", "--steps", "2", "--policies", "elastic", "--json"]
    sibling = ["scheduler.elastic_launch_order=sibling", "scheduler.elastic_duration_prior=auto"]
    untuned = ["sim.tune_knobs=false", *sibling]
    assert main([*flags, "--workload", small, *untuned, "scheduler.elastic_prefetch=trickle"]) == 0
    knobs = json.loads(capsys.readouterr().out)["policies"]["elastic"]["knobs"]
    assert knobs["prefetch"] == "trickle" and knobs["launch_order"] == "sibling"
    assert knobs["duration_prior"]["sigma_log"] == pytest.approx(0.55)  # the workload's own model (nl2repo)
    trace = tmp_path / "bare.jsonl"
    trace.write_text("".join(json.dumps({"start": 0, "end": 60 + i}) + "\n" for i in range(16)))
    assert main([*flags, "--workload", str(trace), *untuned]) == 2
    one_line_error(capsys, "elastic_launch_order=sibling needs a duration model: this workload has none")
