"""`gyre-ray runs`: a summary.json that is JSON but no object is said so (not "empty or cut off"), an
odd config.json gets a note, and a run folder given for ROOT is refused with a hint to its parent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.runs_cli import list_runs


def _run(root: Path, name: str, config: str = '{"run": {"steps": 2}}') -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    return folder


def test_a_summary_that_is_no_object_is_said_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (_run(tmp_path, "listy") / "summary.json").write_text("[1]")
    (run,) = list_runs(tmp_path)
    assert run["status"] == "stopped"
    assert run["error"] == "summary.json [1] is not a JSON object (so no proof the run ended)"
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "listy: summary.json [1] is not a JSON object" in out and "empty or cut off" not in out


@pytest.mark.parametrize(
    ("config", "note"),
    [
        ("[]", "config.json [] is not a JSON object: its step count is unknown"),
        ('{"run": {"ste', "config.json does not read as JSON (empty or cut off): its step count is unknown"),
        ('{"run": 5}', "config.json: run 5 is not an object: its step count is unknown"),
        ('{"run": {"steps": "x"}}', 'config.json: run.steps "x" is not a step count'),
    ],
)
def test_an_odd_config_is_noted_without_changing_the_status(
    tmp_path: Path, capsys: pytest.CaptureFixture, config: str, note: str
) -> None:
    odd = _run(tmp_path, "odd", config)
    (odd / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 3.0}}))
    stopped = _run(tmp_path, "stopped", config)
    runs = {run["name"]: run for run in list_runs(tmp_path)}
    assert runs["odd"]["status"] == "done" and runs["odd"]["error"] == note
    assert runs["stopped"]["status"] == "stopped" and runs["stopped"]["steps_configured"] is None
    assert runs["stopped"]["error"] == note
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"odd: {note}" in out and f"stopped: {note}" in out and f"{stopped.name} " in out


def test_a_run_folder_given_for_root_is_refused_with_its_parent(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _run(tmp_path, "learn-1")
    assert main(["runs", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"gyre-ray runs: {run} looks like a run folder (it holds config.json); give the folder that "
        f"holds run folders, its parent: gyre-ray runs {tmp_path.resolve()}"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["runs", str(empty)]) == 0  # a folder with no run folder is still said plainly
    assert capsys.readouterr().out.strip() == f"no run folders under {empty}"
