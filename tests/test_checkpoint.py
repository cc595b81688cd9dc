"""Run checkpoints are atomic (never half a checkpoint), the newest complete one is found, old ones are
pruned, and a resumed folder sets aside what came after it (the trainer's own save/load round trip is
tests/test_trainer_torch.py's; the whole resume, tests/test_resume_job.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray import checkpoint
from gyre_ray.resume import merge_segments, prepare_resume, segment_offset


def _write_marker(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"w")


def _write_loadable(folder: Path) -> None:
    """A trainer folder whose files read (`checkpoint.problem`): config, safetensors, trainer_state.pt."""
    import torch
    from safetensors.torch import save_file

    from gyre_ray.model.arch import ModelArgs

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(ModelArgs.preset("tiny").to_hf_config()))
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    torch.save({"version": 2}, folder / "trainer_state.pt")


def test_save_then_latest_finds_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path) is None
    first = checkpoint.save(tmp_path, 2, _write_marker, {"version": 2}, keep=0)
    second = checkpoint.save(tmp_path, 4, _write_marker, {"version": 4}, keep=0)
    assert first.name == "step-000002" and checkpoint.latest(tmp_path) == second
    assert checkpoint.load_state(second) == {"version": 4, "step": 4}
    assert (checkpoint.trainer_dir(second) / "weights.bin").is_file()


def test_a_failed_save_leaves_no_checkpoint_and_the_previous_one_stands(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, 1, _write_marker, {})

    def dies_half_way(folder: Path) -> None:
        _write_marker(folder)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, dies_half_way, {})
    assert checkpoint.latest(tmp_path) == good
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]


def test_partial_folders_of_a_crash_are_never_resumed_from(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, 1, _write_marker, {})
    crashed = tmp_path / "checkpoints" / ".step-000002.partial-dead"
    _write_marker(crashed / "trainer")  # the process died before state.json and the rename
    no_state = tmp_path / "checkpoints" / "step-000003"
    _write_marker(no_state / "trainer")  # a folder without state.json is not complete either
    assert checkpoint.latest(tmp_path) == good
    checkpoint.save(tmp_path, 4, _write_marker, {}, keep=0)
    assert not crashed.exists(), "the next save removes a crashed partial folder"


def test_save_keeps_only_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, _write_marker, {}, keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-000003", "step-000004"]


def test_a_save_after_a_skipped_damaged_checkpoint_keeps_itself(tmp_path: Path) -> None:
    """A resume skipped a damaged step 15 and went on from 10: the next save (step 11, keep 1) counted
    step 15 as the newest and pruned itself, leaving nothing good to resume from. Checkpoints past
    the one just written now neither count nor go."""
    checkpoint.save(tmp_path, 10, _write_loadable, {}, keep=0)
    damaged = checkpoint.save(tmp_path, 15, _write_loadable, {}, keep=0)
    state = damaged / checkpoint.TRAINER_DIR / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:10])  # cut short
    assert checkpoint.latest_good(tmp_path).name == "step-000010"
    saved = checkpoint.save(tmp_path, 11, _write_loadable, {}, keep=1)
    assert saved.is_dir() and checkpoint.latest_good(tmp_path) == saved
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-000011", "step-000015"]


def test_require_latest_says_why_there_is_nothing_to_resume(tmp_path: Path) -> None:
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.require_latest(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="not a folder"):
        checkpoint.require_latest(tmp_path / "nope")


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_prepare_resume_sets_aside_what_came_after_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "records").mkdir()
    (tmp_path / "workspaces").mkdir()
    for name in (
        "s0-vowels-0",
        "s1-digits-0",
        "s2-vowels-0",
        "s10-vowels-1",
        "eval2-greeting-0",
        "eval1-greeting-0",
        "r1.s2-digits-0",  # started again after its executor died (runtime.runners.relaunch_id)
        "r2.eval2-greeting-1",
        "r1.s1-digits-1",
    ):
        (tmp_path / "records" / f"{name}.jsonl").write_text("{}\n")
    for name in ("s1-digits-0", "s2-vowels-0", "s2-vowels-0.home", "eval-1", "eval-2", "r1.s2-digits-0"):
        (tmp_path / "workspaces" / name).mkdir()
    _jsonl(tmp_path / "metrics.jsonl", [{"step": s} for s in range(4)])
    _jsonl(tmp_path / "eval.jsonl", [{"step": 0}, {"step": 1}, {"step": 3}])  # step 2's round never ended
    _jsonl(
        tmp_path / "trace.jsonl",
        [{"step": 1, "start": 0.0, "end": 1.0}, {"step": 2, "start": 1.0, "end": 2.0}],
    )
    moved = prepare_resume(tmp_path, 2)
    assert moved["moved"] == 9
    assert sorted(p.stem for p in (tmp_path / "records").iterdir()) == [
        "eval1-greeting-0",
        "r1.s1-digits-1",
        "s0-vowels-0",
        "s1-digits-0",
    ]
    assert sorted(p.name for p in (tmp_path / "workspaces").iterdir()) == ["eval-1", "s1-digits-0"]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0, 1]
    assert (Path(moved["to"]) / "records" / "s10-vowels-1.jsonl").is_file()
    # the rows of steps it drops from metrics.jsonl, trace.jsonl and eval.jsonl are kept aside, not lost
    assert moved["rows_set_aside"] == 4
    aside = Path(moved["to"])
    assert [json.loads(x)["step"] for x in (aside / "metrics.jsonl").read_text().splitlines()] == [2, 3]
    assert [json.loads(x)["step"] for x in (aside / "eval.jsonl").read_text().splitlines()] == [3]
    assert [json.loads(x)["step"] for x in (aside / "trace.jsonl").read_text().splitlines()] == [2]
    # moved, not copied: a later attempt's executions have the same ids, and must not look present
    assert [json.loads(x)["step"] for x in (tmp_path / "trace.jsonl").read_text().splitlines()] == [1]


def test_merge_segments_puts_the_resumed_times_after_the_earlier_ones(tmp_path: Path) -> None:
    _jsonl(
        tmp_path / "trace.jsonl",
        [{"step": 0, "start": 0.0, "end": 5.0}, {"step": 1, "start": 6.0, "end": 9.0}],
    )
    _jsonl(
        tmp_path / "metrics.jsonl", [{"step": 0, "published_at_s": 6.0}, {"step": 1, "published_at_s": 10.0}]
    )
    (tmp_path / "summary.json").write_text(json.dumps({
        "spans": [["cell-0", "rollout", 0.0, 10.0]], "switches": [{"batch": 0, "at_s": 5.0}, {"batch": 1, "at_s": 9.0}],
    }))  # fmt: skip
    offset = segment_offset(tmp_path, 1)  # resumed at step 1: step 1 of the earlier segment is redone
    assert offset == 10.0
    new = {
        "trace": [{"step": 1, "start": 0.5, "end": 3.0}],
        "spans": [("cell-0", "rollout", 0.0, 4.0)],
        "switches": [{"batch": 1, "at_s": 2.0}],
        "steps": [{"step": 1, "published_at_s": 4.0, "switches": [{"batch": 1, "at_s": 2.0}]}],
        "costs": {"steps": 1, "makespan_s": 3.5, "cells": 2},  # the segment's own: 0.5 -> 4.0
    }
    merged = merge_segments(tmp_path, 1, offset, new)
    assert [(r["step"], r["start"]) for r in merged["trace"]] == [(0, 0.0), (1, 10.5)]
    assert merged["spans"] == [("cell-0", "rollout", 0.0, 10.0), ("cell-0", "rollout", 10.0, 14.0)]
    assert [e["at_s"] for e in merged["switches"]] == [5.0, 12.0]
    assert [(m["step"], m["published_at_s"]) for m in merged["steps"]] == [(0, 6.0), (1, 14.0)]
    # a step's own switch events on the run's clock too (they stayed on the segment's: 2.0)
    assert [e["at_s"] for e in merged["steps"][1]["switches"]] == [12.0]
    # the run's costs: both steps, first launch to last update (the segment's covered itself: 3.5 s)
    assert merged["costs"] == {"steps": 2, "makespan_s": 14.0, "cells": 2}


def test_a_segment_killed_while_writing_its_last_files_still_resumes(tmp_path: Path) -> None:
    """A torn summary.json is read as absent and a torn last trace line is left out, so the resumed
    segment starts after what the earlier one finished (no JSONDecodeError)."""
    _jsonl(tmp_path / "trace.jsonl", [{"step": 0, "start": 0.0, "end": 5.0}])
    with (tmp_path / "trace.jsonl").open("a") as trace:
        trace.write('{"step": 1, "start": 6.0, "en')
    (tmp_path / "summary.json").write_text('{"spans": [["cell-0", "rollout", 0.0, 1')
    assert segment_offset(tmp_path, 1) == 5.0
    merged = merge_segments(tmp_path, 1, 5.0, {"trace": [], "spans": [], "switches": [], "steps": []})
    assert [r["step"] for r in merged["trace"]] == [0] and merged["spans"] == []


def test_resume_and_eval_commands_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gyre_ray.cli import main

    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run folder (no config.json)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot resume: " in err and "no complete checkpoint" in err
    assert main(["train", "--resume", str(tmp_path), "--config", "jobs/configs/toy.yaml"]) == 2
    assert "give overrides, not --config" in capsys.readouterr().err
    assert main(["eval", "--run", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["eval", "--model-dir", str(tmp_path / "records")]) == 2
    assert "not an HF model folder" in capsys.readouterr().err
    checkpoint.save(tmp_path, 2, _write_marker, {})  # complete, but its trainer/ holds no model
    assert main(["train", "--resume", str(tmp_path), "run.steps=3"]) == 2
    assert "cannot resume: no checkpoint of" in capsys.readouterr().err
    checkpoint.save(tmp_path, 2, _write_loadable, {})
    assert main(["train", "--resume", str(tmp_path), "run.steps=2"]) == 2
    assert "nothing to resume (give run.steps=3 or more" in capsys.readouterr().err


def test_resuming_with_another_seed_warns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gyre_ray.config import load_config
    from gyre_ray.train import _resume_folder

    saved = checkpoint.save(tmp_path, 2, _write_marker, {"seed": 5})
    same = load_config("jobs/configs/toy.yaml", ["run.steps=3", "run.seed=5"])
    assert _resume_folder(same, tmp_path, saved)[1] == 2
    assert "warning" not in capsys.readouterr().out
    other = load_config("jobs/configs/toy.yaml", ["run.steps=3", "run.seed=7"])
    assert _resume_folder(other, tmp_path, saved)[1] == 2
    assert "ran with run.seed=5, resumed with run.seed=7" in capsys.readouterr().out
