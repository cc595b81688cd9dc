"""`gyre-ray runs`: each run folder's status from what the job left (summary, failed.json, live-run.json,
nothing), its steps, reward and newest checkpoint, and the next step; warm-up caches and other folders
left out; clear errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_ray.checkpoint import CHECKPOINTS, STATE_FILE, TRAINER_DIR, checkpoint_name
from gyre_ray.cli import main
from gyre_ray.runs_cli import list_runs


def make_run(
    root: Path, name: str, steps: int, rewards: list[float], mtime: float, checkpoint: int | None = None
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run": {"steps": steps}}))
    rows = [{"step": i, "reward_mean": r} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 9, "rew'
    )
    if checkpoint is not None:
        saved = folder / CHECKPOINTS / checkpoint_name(checkpoint)
        (saved / TRAINER_DIR).mkdir(parents=True)
        (saved / STATE_FILE).write_text(json.dumps({"step": checkpoint}))
    os.utime(folder / "config.json", (mtime, mtime))
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    done = make_run(tmp_path, "done", 4, [0.1, 0.2, 0.3, 0.5], 100.0, checkpoint=4)
    (done / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 81.5}}))
    failed = make_run(tmp_path, "failed", 4, [0.2], 200.0)
    (failed / "failed.json").write_text(json.dumps({"error": "RuntimeError: the core died"}))
    make_run(tmp_path, "stopped", 6, [0.1, 0.1, 0.2], 300.0, checkpoint=2)
    live = make_run(tmp_path, "live", 6, [], 400.0)
    (live / "live-run.json").write_text("{}")
    torn = make_run(tmp_path, "torn", 2, [0.4, 0.6], 50.0)
    (torn / "summary.json").write_text('{"costs": {"makes')  # killed while writing its last file
    warmup = tmp_path / "warmup-abc"
    warmup.mkdir()
    (warmup / "config.json").write_text("{}")
    (warmup / "warmup.json").write_text("{}")
    (tmp_path / "records").mkdir()
    return tmp_path


def test_each_run_gets_its_status_progress_reward_checkpoint_and_next_step(root: Path) -> None:
    runs = {run["name"]: run for run in list_runs(root)}
    assert [run["name"] for run in list_runs(root)] == [
        "live",
        "stopped",
        "failed",
        "done",
        "torn",
    ]  # newest first
    done = runs["done"]
    assert (done["status"], done["steps_logged"], done["steps_configured"]) == ("done", 4, 4)
    assert done["reward_first"] == pytest.approx(0.15) and done["reward_last"] == pytest.approx(
        0.4
    )  # 2 + 2 of 4
    assert done["makespan_s"] == 81.5 and done["checkpoint_step"] == 4
    assert runs["failed"]["status"] == "failed" and runs["failed"]["error"] == "RuntimeError: the core died"
    assert runs["failed"]["next"].startswith("no checkpoint to resume from")
    stopped = runs["stopped"]
    assert stopped["status"] == "stopped" and stopped["checkpoint_step"] == 2
    assert stopped["next"] == f"gyre-ray train --resume {root / 'stopped'}"
    assert runs["live"]["status"] == "live" and "--attach" in runs["live"]["next"]
    assert runs["live"]["reward_first"] is None
    torn = runs["torn"]  # all its steps logged, but killed while writing summary.json: it did not end
    assert (torn["status"], torn["steps_logged"], torn["makespan_s"]) == ("stopped", 2, None)
    assert torn["error"] == "summary.json is empty or cut off (the job was killed while writing it)"
    assert torn["next"].startswith("no checkpoint to resume from")


def test_the_command_prints_a_table_and_json_and_says_what_is_wrong(
    root: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture
) -> None:
    assert main(["runs", str(root)]) == 0
    out = capsys.readouterr().out
    table = {line.split()[0]: line for line in out.splitlines()[1:6]}
    assert set(table) == {"live", "stopped", "failed", "done", "torn"}
    assert "done" in table["done"] and "4/4" in table["done"] and "0.150 -> 0.400" in table["done"]
    assert "81.5 s" in table["done"]
    assert "failed: RuntimeError: the core died" in out
    assert "stopped" in table["torn"] and "2/2" in table["torn"]
    assert "torn: summary.json is empty or cut off (the job was killed while writing it)" in out
    assert f"stopped: gyre-ray train --resume {root / 'stopped'}" in out
    assert "warmup-abc" not in out and "records" not in out
    assert main(["runs", str(root), "--json"]) == 0
    assert {run["name"] for run in json.loads(capsys.readouterr().out)} == set(table)
    empty = tmp_path_factory.mktemp("empty")
    assert main(["runs", str(empty)]) == 0
    assert f"no run folders under {empty}" in capsys.readouterr().out
    assert main(["runs", str(empty / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_a_live_run_says_whether_its_driver_still_runs(tmp_path: Path) -> None:
    """A live-run.json outlives a driver killed with its cluster: the next step must say so."""
    here = socket.gethostname()
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train"])
    ended = subprocess.Popen([sys.executable, "-c", "pass", "train"])
    ended.wait()
    try:
        drivers = {
            "running": {"pid": driver.pid, "host": here},
            "gone": {"pid": ended.pid, "host": here},
            "elsewhere": {"pid": driver.pid, "host": here + "-other"},
        }
        for name, recorded in drivers.items():
            folder = make_run(tmp_path, name, 4, [], 100.0)
            (folder / "live-run.json").write_text(json.dumps({"driver": recorded}))
        runs = {run["name"]: run for run in list_runs(tmp_path)}
    finally:
        driver.kill()
        driver.wait()
    assert all(run["status"] == "live" for run in runs.values())
    assert {name: run["driver"] for name, run in runs.items()} == {n: n for n in drivers}
    assert runs["running"]["next"].startswith("its driver still runs on this host")
    assert "driver is gone" in runs["gone"]["next"] and "--resume" in runs["gone"]["next"]
    assert runs["elsewhere"]["next"].endswith("(if its driver died)")


@pytest.mark.parametrize("summary", ["", "{}", "[1, 2]", '{"costs": {"makes'])
def test_an_empty_or_torn_summary_is_no_proof_the_run_ended(tmp_path: Path, summary: str) -> None:
    """Killed while writing summary.json: `stopped` (resume from its checkpoint), unless its
    failed.json or live-run.json says more."""
    for name in ("bare", "failed", "live"):
        folder = make_run(tmp_path, name, 2, [0.4, 0.6], 100.0, checkpoint=1)
        (folder / "summary.json").write_text(summary)
    (tmp_path / "failed" / "failed.json").write_text(json.dumps({"error": "interrupted"}))
    (tmp_path / "live" / "live-run.json").write_text("{}")
    runs = {run["name"]: run for run in list_runs(tmp_path)}
    assert {name: run["status"] for name, run in runs.items()} == {
        "bare": "stopped",
        "failed": "failed",
        "live": "live",
    }
    assert runs["bare"]["next"] == f"gyre-ray train --resume {tmp_path / 'bare'}"
    assert runs["failed"]["error"] == "interrupted" and runs["live"]["error"] is None


def test_steps_that_scored_nothing_count_as_logged_without_a_reward(tmp_path: Path) -> None:
    """Every execution dropped: metrics.jsonl logs reward_mean null, which must not break the list."""
    folder = make_run(tmp_path, "dropped", 3, [], 100.0)
    rows = [
        {"step": 0, "reward_mean": None},
        {"step": 1, "reward_mean": 0.5},
        {"step": 2, "reward_mean": None},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run,) = list_runs(tmp_path)
    assert run["steps_logged"] == 3 and run["reward_first"] == run["reward_last"] == 0.5
    (folder / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (run,) = list_runs(tmp_path)
    assert run["steps_logged"] == 1 and run["reward_first"] is None


def test_failed_json_wins_over_a_summary(tmp_path: Path) -> None:
    """A run that scored nothing, or a resumed segment that failed after an earlier one ended, has both."""
    folder = make_run(tmp_path, "both", 2, [], 100.0)
    (folder / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 9.0}}))
    (folder / "failed.json").write_text(json.dumps({"error": "RuntimeError: no execution was scored"}))
    (run,) = list_runs(tmp_path)
    assert run["status"] == "failed" and run["error"].endswith("no execution was scored")
    assert run["next"].startswith("fix the harness")


ODD_FILES = {  # valid JSON (or bytes) the job never writes: each crashed `gyre-ray runs` with a traceback
    "metrics-text-reward": (
        "metrics.jsonl",
        '{"reward_mean": 0.5}\n{"reward_mean": "x"}\n',
        "line 2: reward_mean",
    ),
    "metrics-bool-reward": ("metrics.jsonl", '{"reward_mean": true}\n', "line 1: reward_mean true is not"),
    "metrics-number-row": ("metrics.jsonl", "5\n", "metrics.jsonl line 1 is not a JSON object"),
    "metrics-not-utf8": ("metrics.jsonl", b"\xff\xfe\n", "metrics.jsonl could not be read"),
    "summary-costs-list": ("summary.json", '{"costs": [1]}', "summary.json: costs [1] is not an object"),
    "summary-makespan-text": (
        "summary.json",
        '{"costs": {"makespan_s": "x"}}',
        'makespan_s "x" is not a number',
    ),
    "config-huge-steps": ("config.json", '{"run": {"steps": 1e400}}', None),
}


@pytest.mark.parametrize("case", sorted(ODD_FILES))
def test_a_file_with_odd_content_makes_its_run_stopped_with_a_note_and_hides_no_other_run(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    good = make_run(tmp_path, "good", 2, [0.25, 0.75], 100.0)
    (good / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 3.0}}))
    odd = make_run(tmp_path, "odd", 2, [0.5], 200.0)
    (odd / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 9.0}}))  # would be `done`
    name, content, note = ODD_FILES[case]
    target = odd / name
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    os.utime(odd / "config.json", (200.0, 200.0))
    runs = {run["name"]: run for run in list_runs(tmp_path)}
    assert runs["good"]["status"] == "done" and runs["good"]["reward_last"] == 0.75
    if note is None:  # an odd config.json only loses the configured step count
        assert runs["odd"]["status"] == "done" and runs["odd"]["steps_configured"] is None
    else:
        assert runs["odd"]["status"] == "stopped" and note in runs["odd"]["error"]
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "good " in out and "odd " in out and (note is None or f"odd: {runs['odd']['error']}" in out)
    assert main(["runs", str(tmp_path), "--json"]) == 0
    assert {run["name"] for run in json.loads(capsys.readouterr().out)} == {"good", "odd"}


def test_odd_failed_live_and_checkpoint_files_are_noted_not_fatal(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    failed = make_run(tmp_path, "failed", 2, [], 100.0)
    (failed / "failed.json").write_text(json.dumps({"error": 5}))
    live = make_run(tmp_path, "live", 2, [], 200.0)
    driver = {"pid": "1\u0000", "host": socket.gethostname()}  # once an embedded-null ValueError
    (live / "live-run.json").write_text(json.dumps({"driver": driver}))
    ckpt = make_run(tmp_path, "ckpt", 2, [0.5], 300.0, checkpoint=1)
    (ckpt / CHECKPOINTS / checkpoint_name(1) / STATE_FILE).write_text(json.dumps({"step": "x"}))
    runs = {run["name"]: run for run in list_runs(tmp_path)}
    assert (
        runs["failed"]["status"] == "failed" and runs["failed"]["error"] == "failed.json: error 5 is not text"
    )
    assert runs["live"]["status"] == "live" and runs["live"]["driver"] == "elsewhere"
    assert "live-run.json: driver pid" in runs["live"]["error"]
    assert runs["ckpt"]["status"] == "stopped" and runs["ckpt"]["checkpoint_step"] is None
    assert "state.json holds no step number" in runs["ckpt"]["error"]
    assert main(["runs", str(tmp_path)]) == 0
    assert "failed: failed.json: error 5 is not text" in capsys.readouterr().out


def test_a_short_runs_trend_compares_ends_that_do_not_overlap_as_train_says(tmp_path: Path) -> None:
    """With fixed 3-step ends a 4-step run compared overlapping windows (train: +0.130, runs: a
    decline), and a 2- or 3-step run showed the same reward at both ends."""
    from gyre_ray.train import reward_trend

    rewards = [0.2, 0.45, 0.4, 0.5]
    make_run(tmp_path, "four", 4, rewards, 100.0)
    (run,) = list_runs(tmp_path)
    assert run["reward_first"] == pytest.approx(0.325) and run["reward_last"] == pytest.approx(0.45)
    line = reward_trend([{"reward_mean": r} for r in rewards])
    assert "first 2 step(s) 0.325 -> last 2 step(s) 0.450" in line


def test_a_run_whose_driver_runs_here_is_running_and_a_killed_ones_is_stopped(tmp_path: Path) -> None:
    """Local runs write no live-run.json: one in progress was listed `stopped`, told to start again;
    a resumed one in progress (or killed) `done`, from the earlier segment's summary.json."""
    from gyre_ray.live_run import DRIVER_FILE
    from gyre_ray.resume import EARLIER_SUMMARY, set_summary_aside

    here = socket.gethostname()
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train"])
    ended = subprocess.Popen([sys.executable, "-c", "pass", "train"])
    ended.wait()
    try:
        for name, pid in (("running", driver.pid), ("killed", ended.pid)):
            folder = make_run(tmp_path, name, 8, [0.1, 0.2, 0.3], 100.0, checkpoint=3)
            (folder / "summary.json").write_text(json.dumps({"costs": {"makespan_s": 15.2}}))
            (folder / "failed.json").write_text(json.dumps({"error": "RuntimeError: an earlier segment"}))
            set_summary_aside(folder)  # what a resume does once its checkpoint is restored
            (folder / DRIVER_FILE).write_text(json.dumps({"pid": pid, "host": here}))
        runs = {run["name"]: run for run in list_runs(tmp_path)}
    finally:
        driver.kill()
        driver.wait()
    assert runs["running"]["status"] == "running" and "wait for it" in runs["running"]["next"]
    assert runs["killed"]["status"] == "failed"  # the earlier segment's failure, not done
    assert not (tmp_path / "running" / "summary.json").exists()
    assert (tmp_path / "running" / EARLIER_SUMMARY).is_file()


def test_warm_up_leftovers_and_a_checkpoint_without_a_step_are_not_taken_for_runs(tmp_path: Path) -> None:
    saving = tmp_path / "warmup-0123456789ab.tmp"  # a warm-up killed while saving its HF folder
    saving.mkdir()
    (saving / "config.json").write_text(json.dumps({"vocab_size": 100, "model_type": "qwen3"}))
    folder = make_run(tmp_path, "run", 4, [0.1, 0.2], 100.0, checkpoint=1)
    newer = folder / CHECKPOINTS / checkpoint_name(2)
    (newer / TRAINER_DIR).mkdir(parents=True)
    (newer / STATE_FILE).write_text("{}")  # no step: damaged, as --resume reads it
    (run,) = list_runs(tmp_path)
    assert run["name"] == "run" and run["checkpoint_step"] == 1
    assert "step-000002: its state.json holds no step number" in run["error"]


def test_a_line_nested_too_deep_is_a_note_not_a_traceback(tmp_path: Path, capsys) -> None:
    folder = make_run(tmp_path, "deep", 4, [0.1], 100.0)
    (folder / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "reward_mean": 0.1}) + "\n" + "[" * 100000 + "\n"
    )
    make_run(tmp_path, "other", 4, [0.3], 50.0)
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "other" in out and "deep" in out
    assert main(["report", str(folder)]) == 2
    assert "nested too deep" in capsys.readouterr().err
