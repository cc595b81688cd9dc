"""One definition of a run folder (`gyre_ray.run_folder`): `gyre-ray runs` (a run folder given for
ROOT) and the commands that take an HF model folder (`eval --model-dir`) recognise the same folders.
They used to decide from different file lists: a run that had only failed.json or live-run.json
beside its config was a run to one and not to the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.run_folder import JOB_FILES, is_run_folder, job_files

RUNS = {
    "config with a run section only": {"config.json": json.dumps({"run": {"steps": 2}})},
    "a failed run": {"config.json": "{}", "failed.json": json.dumps({"error": "boom"})},
    "a live run": {"config.json": "{}", "live-run.json": "{}"},
    "a cut-off config beside metrics": {"config.json": '{"run": {"st', "metrics.jsonl": ""},
}
NOT_RUNS = {
    "an HF model folder": {"config.json": json.dumps({"vocab_size": 8, "model_type": "qwen3"})},
    "a config with no run section": {"config.json": json.dumps({"anything": 1})},
    "no config.json": {"metrics.jsonl": ""},
}


def _folder(root: Path, files: dict[str, str]) -> Path:
    folder = root / "run-a"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("files", RUNS.values(), ids=RUNS.keys())
def test_every_command_takes_a_run_folder_for_one(
    tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    folder = _folder(tmp_path, files)
    assert is_run_folder(folder)
    assert main(["runs", str(folder)]) == 2
    assert f"{folder} looks like a run folder" in capsys.readouterr().err
    assert main(["eval", "--model-dir", str(folder)]) == 2
    assert f"--model-dir {folder} is a run folder, not an HF model folder" in capsys.readouterr().err


@pytest.mark.parametrize("files", NOT_RUNS.values(), ids=NOT_RUNS.keys())
def test_no_command_takes_other_folders_for_a_run(
    tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    folder = _folder(tmp_path, files)
    assert not is_run_folder(folder)
    assert main(["runs", str(folder)]) == 0
    assert "looks like a run folder" not in capsys.readouterr().err
    main(["eval", "--model-dir", str(folder)])
    assert "is a run folder" not in capsys.readouterr().err


def test_the_job_file_names_are_the_ones_the_job_writes() -> None:
    from gyre_ray.evaluation import EVAL_FILE
    from gyre_ray.live_run import LIVE_FILE
    from gyre_ray.sim.replay import COSTS_FILE, TRACE_FILE
    from gyre_ray.train import FAILED_FILE

    assert {EVAL_FILE, LIVE_FILE, COSTS_FILE, TRACE_FILE, FAILED_FILE} <= set(JOB_FILES)


def test_job_files_lists_config_first(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"summary.json": "{}", "config.json": "{}", "trace.jsonl": ""})
    assert job_files(folder) == ["config.json", "trace.jsonl", "summary.json"]


def test_a_run_file_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    """trace.jsonl (which after a resume holds the earlier segments' rows too), costs.json and
    summary.json were rewritten in place: a job killed mid-write left them short for good."""
    from gyre_ray.run_folder import replace_jsonl

    path = tmp_path / "trace.jsonl"
    replace_jsonl(path, [{"exec_id": "a"}, {"exec_id": "b"}])
    before = path.read_text()

    def killed(self, *_args, **_kwargs):  # the write dies half-way
        Path.write_bytes(self, b'{"exec_id": "c"}\n{"ex')
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        replace_jsonl(path, [{"exec_id": "a"}, {"exec_id": "b"}, {"exec_id": "c"}])
    monkeypatch.undo()
    assert path.read_text() == before and before.count("\n") == 2
