"""`gyre-ray simulate` and `gyre-ray plan`: table, JSON, plot, recommendations and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import build_parser, main

SMALL = """\
extends: nl2repo
name: small
tasks_per_step: 4
group_size: 4
"""


@pytest.fixture()
def small(tmp_path: Path) -> str:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return str(path)


def test_simulate_and_plan_are_registered() -> None:
    text = build_parser().format_help()
    assert "simulate" in text and "plan" in text


def test_simulate_json_has_every_policy_with_the_documented_fields(small: str, capsys) -> None:
    code = main(
        ["simulate", "--workload", small, "--steps", "3", "--cells", "4", "--staleness", "1", "--json"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"colocate", "async", "elastic"}
    for row in report["policies"].values():
        assert {"makespan_s", "lower_bound_s", "utilization", "mean_staleness", "switches"} <= set(row)
        assert row["makespan_s"] >= row["lower_bound_s"] > 0
        assert 0 < row["utilization"] <= 1
    assert report["policies"]["colocate"]["mean_staleness"] == 0
    assert report["policies"]["async"]["switches"] == 0
    assert set(report["policies"]["async"]["knobs"]["sweep_makespan_s"]) == {"1", "2", "3"}
    elastic = report["policies"]["elastic"]["makespan_s"]
    colocate = report["policies"]["colocate"]["makespan_s"]
    assert report["speedups"]["elastic_vs_colocate"] == pytest.approx(colocate / elastic, rel=1e-3)


def test_simulate_table_and_plot(small: str, tmp_path: Path, capsys) -> None:
    png = tmp_path / "timeline.png"
    args = ["--steps", "2", "--cells", "3", "--policies", "colocate,elastic", "--plot", str(png)]
    code = main(["simulate", "--workload", small, *args])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0
    assert "colocate" in out and "elastic" in out and "async" not in out.split("\n", 2)[2]
    # progress on stderr: each policy, and each elastic candidate as it finishes
    progress = captured.err.splitlines()
    assert progress[0].startswith("gyre-ray simulate: colocate: ") and progress[-1].startswith(
        "gyre-ray simulate: elastic: "
    )
    assert any(line.startswith("gyre-ray simulate: elastic trickle: ") for line in progress)
    assert "elastic vs colocate" in out and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_simulate_reads_knobs_from_config_overrides(small: str, capsys) -> None:
    args = ["simulate", "--workload", small, "--steps", "2", "--cells", "4", "--policies", "async", "--json"]
    assert main([*args, "sim.tune_knobs=false", "scheduler.async_train_cells=3"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["async"]["knobs"] == {"train_cells": 3}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--workload", "nope"], "not a preset"),
        (["--policies", "colocate,fifo"], "unknown policy fifo"),
        (["--cells", "1", "--policies", "async"], "async needs --cells >= 2"),
        (["--steps", "0"], "--steps >= 1"),
        (["--plot", "/nonexistent-folder/t.png"], "folder /nonexistent-folder does not exist"),
        (["--plot", "t.png", "--plot-hours", "0"], "--plot-hours must be > 0"),
        (["--plot-hours", "2"], "--plot-hours needs --plot FILE"),
        (["--plot", "t.txt"], "--plot t.txt: plots are written as png, pdf, svg, not .txt"),
        (["--seed", "-5"], "need --seed >= 0, got -5"),
        (["--cells", "20000"], "need --cells <= 10,000, got 20,000"),
        (["--jobs", "0"], "need --jobs >= 1, got 0"),
    ],
)
def test_simulate_errors_are_clear(small: str, args: list[str], message: str, capsys) -> None:
    base = ["simulate", "--steps", "1", "--cells", "2"]
    if "--workload" not in args:
        base += ["--workload", small]
    assert main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plot_path_is_checked_before_simulating_and_the_file_written_is_printed(
    small: str, tmp_path: Path, capsys
) -> None:
    base = ["simulate", "--workload", small, "--steps", "1", "--cells", "2", "--policies", "colocate"]
    assert main([*base, "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # one line: no simulation ran (it prints a line per policy)
    assert (
        err
        == f"gyre-ray simulate: --plot {tmp_path} is a folder; give a file name such as {tmp_path / 'timeline.png'}\n"
    )
    assert main([*base, "--plot", str(tmp_path / "noext")]) == 0
    assert f"wrote {tmp_path / 'noext.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext").exists()
    assert main([*base, "--plot", str(tmp_path / "t.svg")]) == 0
    assert b"<svg" in (tmp_path / "t.svg").read_bytes()[:1000]


def test_simulate_refuses_non_finite_costs(small: str, capsys) -> None:
    assert main(["simulate", "--workload", small, "--steps", "1", "sim.weight_sync_s=inf"]) == 2
    assert "sim.weight_sync_s: Input should be a finite number" in capsys.readouterr().err
    assert main(["simulate", "--workload", small, "--steps", "1", "sim.seed=-1"]) == 2  # numpy needs >= 0
    assert "sim.seed: Input should be greater than or equal to 0 (got -1)" in capsys.readouterr().err


def test_simulate_rejects_bad_config_keys(small: str, capsys) -> None:
    assert main(["simulate", "--workload", small, "sim.weight_sink_s=1"]) == 2
    assert "sim.weight_sink_s: unknown key" in capsys.readouterr().err


def test_plan_sweeps_cell_sizes_and_recommends_one(small: str, capsys) -> None:
    args = ["plan", "--workload", small, "--nodes", "8", "--steps", "2", "--min-cell-nodes", "2", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    sizes = sorted(x["cell_nodes"] for x in report["layouts"])
    assert sizes == [2, 4]  # 8 nodes: cells of 2 (4 cells) or 4 (2 cells); 1-node cells are too small
    fastest = min(report["layouts"], key=lambda x: x["makespan_s"])
    assert report["recommended"]["8"]["makespan_s"] <= fastest["makespan_s"] * 1.01
    assert all(x["makespan_s"] >= x["lower_bound_s"] for x in report["layouts"])


def test_plan_table_and_errors(small: str, capsys) -> None:
    assert main(["plan", "--workload", small, "--nodes", "4", "--steps", "1"]) == 0
    assert "recommended for 4 nodes" in capsys.readouterr().out
    assert main(["plan", "--workload", small, "--nodes", "4", "--cell-nodes", "3"]) == 2
    assert "do not divide 4 nodes" in capsys.readouterr().err
    assert main(["plan", "--workload", small, "--nodes", "4", "--min-cell-nodes", "4"]) == 2
    assert "min_cell_nodes" in capsys.readouterr().err
    assert main(["plan", "--workload", small, "--nodes", "4", "--reference-nodes", "0"]) == 2
    assert "--reference-nodes must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cell-nodes", "0"], "--cell-nodes must list cell sizes >= 1 node, got [0]"),
        (["--cell-nodes", ","], "--cell-nodes must list cell sizes >= 1 node, got []"),
        (["--seed", "-5"], "--seed must be >= 0, got -5"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--jobs", "-1"], "--jobs must be >= 1, got -1"),
        (["--staleness", "-1"], "--staleness must be >= 0, got -1"),
        (["--nodes", "20000"], "--nodes must list cluster sizes from 2 to 10,000, got [20000]"),
    ],
)
def test_plan_errors_name_the_flag(small: str, args: list[str], message: str, capsys) -> None:
    assert main(["plan", "--workload", small, "--nodes", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"gyre-ray plan: {message}\n"


def test_plan_prints_a_progress_line_per_layout_on_stderr(small: str, capsys) -> None:
    args = ["plan", "--workload", small, "--nodes", "4,8", "--steps", "1", "--min-cell-nodes", "2", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON alone
    lines = captured.err.splitlines()
    assert len(lines) == len(report["layouts"]) == 3  # 4 nodes: 2 x 2; 8 nodes: 4 x 2, 2 x 4
    assert lines[0].startswith("gyre-ray plan: 4 nodes as 2 cells of 2 nodes: ")
    assert lines[-1].startswith("gyre-ray plan: 8 nodes as 2 cells of 4 nodes: ")
    assert (
        " h per step, " in lines[-1] and " x bound (3/3, " in lines[-1] and lines[-1].endswith(" s in all)")
    )


def test_the_plot_names_its_update_lines_and_a_short_axis_is_not_in_hours(
    small: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    from gyre_ray.sim.plot import _time_unit

    figures: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    base = ["simulate", "--workload", small, "--steps", "1", "--cells", "2", "--policies", "colocate"]
    assert main([*base, "--plot", str(tmp_path / "t.png"), "--plot-hours", "0.1"]) == 0
    fig = figures[-1]
    assert "optimizer update" in [t.get_text() for t in fig.legends[0].get_texts()]  # the thin lines
    ax = fig.axes[-1]
    assert ax.get_xlabel() == "time (seconds)" and ax.get_xlim() == pytest.approx((0, 360))  # was 0.0-0.1 h
    assert " min, " in ax.get_title(loc="left")  # the run's own length (40 min), longer than the zoom
    # a replayed run of minutes: was "0.1 h, ..., bound 0.1 h" on an axis of 0.00-0.12 hours
    assert [_time_unit(s)[1] for s in (270.0, 1200.0, 3600.0)] == ["s", "min", "h"]


def test_elastic_candidates_simulated_in_processes_give_the_same_result(small: str) -> None:
    """`--jobs` (default: the CPUs) only changes how long the search takes, not what it finds."""
    from gyre_ray.sim.runner import best_elastic
    from gyre_ray.sim.workload import load_workload, sample_workload

    spec, base_dir = load_workload(small)
    wl = sample_workload(spec, 3, 0, base_dir)
    lines: dict[int, list[str]] = {1: [], 2: []}
    alone, parallel = (best_elastic(wl, 3, 1, progress=lines[j].append, jobs=j) for j in (1, 2))
    assert parallel.makespan_s == alone.makespan_s and parallel.knobs == alone.knobs
    assert (
        len(alone.knobs["sweep_makespan_s"]) == 7 and len(set(alone.knobs["sweep_makespan_s"].values())) > 1
    )
    assert len(lines[2]) == 7 and sorted(line.split(": ")[0] for line in lines[2]) == sorted(
        line.split(": ")[0] for line in lines[1]
    )
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        best_elastic(wl, 3, 1, jobs=0)


def test_without_a_process_pool_the_candidates_run_one_at_a_time(small: str, monkeypatch) -> None:
    from gyre_ray.sim import runner
    from gyre_ray.sim.workload import load_workload, sample_workload

    def no_pool(jobs: int):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(runner, "_pool", no_pool)
    spec, base_dir = load_workload(small)
    wl = sample_workload(spec, 2, 0, base_dir)
    lines: list[str] = []
    result = runner.best_elastic(wl, 3, 1, progress=lines.append, jobs=4)
    assert "cannot start 4 processes" in lines[0] and "one at a time" in lines[0]
    assert len(lines) == 8 and result.makespan_s == runner.best_elastic(wl, 3, 1).makespan_s
