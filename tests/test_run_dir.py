"""Run folders land in a place that outlives the job, also under `ray job submit`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_ray.train import runs_root


def test_relative_run_dir_resolves_against_the_working_directory(tmp_path: Path) -> None:
    assert runs_root("runs", cwd=tmp_path) == (tmp_path / "runs").resolve()
    assert runs_root(str(tmp_path / "abs")) == tmp_path / "abs"


def test_relative_run_dir_inside_a_ray_job_working_dir_moves_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job_dir = tmp_path / "ray/session_1/runtime_resources/working_dir_files/_ray_pkg_abc"
    root = runs_root("runs", cwd=job_dir)
    assert root == tmp_path / "home" / "gyre-ray" / "runs"
    assert "Ray deletes" in capsys.readouterr().out
