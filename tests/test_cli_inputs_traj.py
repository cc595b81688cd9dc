"""`gyre-ray traj show RUN_DIR`: a run folder given for its records is read through RUN_DIR/records
(its metrics.jsonl and trace.jsonl are no call records); one without records/ is one line with a hint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.trajectory.records import write_jsonl
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

WORKLOAD = SyntheticWorkload(system_tokens=16, task_tokens=4, subagent_system_tokens=8, segments=(2, 2))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "learn-1"
    (run / "records").mkdir(parents=True)
    for execution_id, seed in (("a", 4), ("b", 5)):
        write_jsonl(
            run / "records" / f"{execution_id}.jsonl", synthetic_execution(execution_id, seed, WORKLOAD)[0]
        )
    (run / "config.json").write_text(json.dumps({"run": {"steps": 2}, "model": {}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    (run / "trace.jsonl").write_text(json.dumps({"start": 0.0, "end": 1.0, "task": "t", "step": 0}) + "\n")
    return run


def test_a_run_folder_is_read_through_its_records(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["traj", "show", str(run_dir)]) == 0
    from_run = capsys.readouterr()
    assert from_run.err == ""
    assert (
        from_run.out.splitlines()[0] == f"{run_dir / 'records'}: 2 executions; show one with --execution ID"
    )
    assert main(["traj", "show", str(run_dir / "records")]) == 0
    assert capsys.readouterr().out == from_run.out
    assert main(["traj", "show", str(run_dir), "--execution", "b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["executions"][0]["execution_id"] == "b"


def test_a_run_folder_without_records_is_one_line_with_a_hint(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    for path in (run_dir / "records").iterdir():
        path.unlink()
    (run_dir / "records").rmdir()
    assert main(["traj", "show", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"gyre-ray traj show: {run_dir} is a run folder (config.json, metrics.jsonl, trace.jsonl) with no "
        "records/ folder: give the folder of call records (proxy.records_dir) or one <execution_id>.jsonl"
    )
    assert "missing field" not in err


def test_a_run_folder_is_shown_with_the_runs_own_trajectory_settings(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """Training selects with the run's `trajectory` section and its tokenizer's decode; `traj show RUN_DIR`
    used the defaults, so it could show another selection than the one trained."""
    (run_dir / "config.json").write_text(json.dumps({"model": {}, "trajectory": {"budget": 2}}))
    assert main(["traj", "show", str(run_dir), "--execution", "a", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["budget"] == 2 and shown["executions"][0]["paths_selected"] <= 2
    assert main(["traj", "show", str(run_dir), "--execution", "a", "--json", "--budget", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == 4  # the flag still wins
    assert main(["traj", "show", str(run_dir / "records"), "--execution", "a", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == 5  # a records folder alone: the defaults
