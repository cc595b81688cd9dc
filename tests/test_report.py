"""`gyre-ray report`: the pictures and page of a run folder, and the numbers they are drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.observability.report import ReportError, rewards_by_task, running_over_time, write_report

TRACE = [
    {"start": 0.0, "end": 4.0, "task": "s0-vowels", "step": 0, "reward": 0.5, "dropped": False},
    {"start": 0.0, "end": 9.0, "task": "s0-vowels", "step": 0, "reward": 0.7, "dropped": False},
    {"start": 5.0, "end": 7.0, "task": "s1-brackets", "step": 1, "reward": None, "dropped": True},
    {"start": 6.0, "end": 12.0, "task": "s1-vowels", "step": 1, "reward": 0.9, "dropped": False},
]


def _run_dir(tmp_path: Path) -> Path:
    steps = [
        {"step": 0, "reward_mean": 0.6, "valid": 2, "executions": 2, "published_at_s": 10.0,
         "staleness": {"max": 0, "mean": 0.0}, "loss": 0.1, "grad_norm": 1.0},
        {"step": 1, "reward_mean": 0.9, "valid": 1, "executions": 2, "published_at_s": 13.0,
         "staleness": {"max": 1, "mean": 0.4}, "loss": 0.05, "grad_norm": 0.8},
    ]  # fmt: skip
    summary = {
        "steps": steps,
        "utilisation": {"cell-0": {}, "cell-1": {}},
        "spans": [["cell-0", "rollout", 0.0, 9.0], ["cell-0", "switching", 9.0, 9.2],
                  ["cell-0", "training", 9.2, 10.0], ["cell-1", "rollout", 0.0, 12.0]],
        "switches": [{"direction": "rollout->train", "at_s": 9.0, "seconds": 0.2}],
    }  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_running_executions_step_up_and_down() -> None:
    times, counts = running_over_time(TRACE)
    assert counts[-1] == 0
    at = dict(zip(times, counts, strict=True))
    assert (at[4.0], at[5.0], at[6.0], at[7.0], at[9.0]) == (1, 2, 3, 2, 1)  # step 1 overlaps step 0


def test_rewards_by_task_drop_the_step_prefix_and_dropped_executions() -> None:
    assert rewards_by_task(TRACE) == {"vowels": {0: pytest.approx(0.6), 1: 0.9}}


def test_report_writes_every_picture_and_a_page(tmp_path: Path) -> None:
    rounds = [
        {"step": s, "reward_mean": r, "pass_rate": p, "tasks": {"greeting": {"reward": r, "pass_rate": p}}}
        for s, r, p in ((0, 0.3, 0.0), (2, 0.5, 0.5))
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    index = write_report(_run_dir(tmp_path))
    names = {"reward.png", "timeline.png", "switches.png", "staleness.png", "eval.png"}
    for name in names:
        data = (index.parent / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    page = index.read_text()
    assert all(f'src="{n}"' in page for n in names) and page.count("<tr>") == 3


def test_a_step_without_reward_is_a_gap_not_a_zero(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows.append({**rows[1], "step": 2, "reward_mean": None, "valid": 0})  # every execution dropped
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    (run / "eval.jsonl").write_text(
        json.dumps({"step": 0, "reward_mean": None, "pass_rate": 0.0, "tasks": {}})
    )
    index = write_report(run)
    assert (index.parent / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert index.read_text().count("<tr>") == 4


def test_a_run_without_evaluation_still_gets_its_evaluation_picture(tmp_path: Path) -> None:
    index = write_report(_run_dir(tmp_path))  # no eval.jsonl: run.eval_every=0
    assert (index.parent / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl, trace.jsonl, summary.json" in capsys.readouterr().err
    with pytest.raises(ReportError, match="is not a folder"):
        write_report(tmp_path / "nope")
