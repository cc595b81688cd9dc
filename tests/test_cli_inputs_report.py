"""`gyre-ray report` on run files whose lines are JSON objects but hold what the job never writes: one
line naming file, line and field, exit code 2, no traceback (the convention for a bad line before the
last); a `summary.json` that is not what the job writes is left out like a torn one, with a note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main

GOOD_STEP = {"step": 0, "reward_mean": 0.5, "staleness": {"max": 0, "mean": 0.0}}
GOOD_TRACE = {"start": 0.0, "end": 4.0, "task": "s0-vowels", "step": 0, "reward": 0.5, "dropped": False}
SUMMARY = {
    "steps": [{"step": 0, "published_at_s": 5.0}],
    "utilisation": {"cell-0": {}},
    "spans": [["cell-0", "rollout", 0.0, 4.0]],
    "switches": [{"direction": "rollout->train", "at_s": 4.0, "seconds": 0.2}],
}


def _run(tmp_path: Path, steps: list[dict], trace: list[dict], summary: object = SUMMARY) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def _report(capsys: pytest.CaptureFixture, run: Path) -> tuple[int, str, str]:
    code = main(["report", str(run)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("name", "row", "message"),
    [
        ("trace.jsonl", {"start": "x"}, 'trace.jsonl:1: start "x" is not a number'),
        ("trace.jsonl", {"start": 0.0}, "trace.jsonl:1: lacks the field end"),
        ("trace.jsonl", {"start": "x", "end": 1}, 'trace.jsonl:1: start "x" is not a number'),
        ("trace.jsonl", {**GOOD_TRACE, "end": None}, "trace.jsonl:1: end null is not a number"),
        ("trace.jsonl", {**GOOD_TRACE, "step": 1.7}, "trace.jsonl:1: step 1.7 is not an integer"),
        ("trace.jsonl", {**GOOD_TRACE, "reward": "0.5"}, 'trace.jsonl:1: reward "0.5" is not a number'),
        ("trace.jsonl", {**GOOD_TRACE, "dropped": "no"}, 'trace.jsonl:1: dropped "no" is not true or false'),
        ("metrics.jsonl", {"step": 0, "reward_mean": "high"}, 'metrics.jsonl:1: reward_mean "high" is not'),
        ("metrics.jsonl", {"step": "x", "reward_mean": 0.5}, 'metrics.jsonl:1: step "x" is not an integer'),
        ("metrics.jsonl", {"reward_mean": 0.5}, "metrics.jsonl:1: lacks the field step"),
        ("metrics.jsonl", {**GOOD_STEP, "staleness": 3}, "metrics.jsonl:1: staleness 3 is not an object"),
        (
            "metrics.jsonl",
            {**GOOD_STEP, "reward_by_task": {"a": "x"}},
            'metrics.jsonl:1: reward_by_task.a "x" is not a number or null',
        ),
        (
            "eval.jsonl",
            {"step": 0, "reward_mean": 0.5, "tasks": {}},
            "eval.jsonl:1: lacks the field pass_rate",
        ),
        (
            "eval.jsonl",
            {"step": 0, "reward_mean": 0.5, "pass_rate": 0.0, "tasks": {"a": {"reward": "x"}}},
            'eval.jsonl:1: tasks.a: reward "x" is not a number or null',
        ),
    ],
)
def test_a_json_line_with_a_bad_field_is_one_line_naming_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str, row: dict, message: str
) -> None:
    run = _run(tmp_path, [GOOD_STEP, {**GOOD_STEP, "step": 1}], [GOOD_TRACE, {**GOOD_TRACE, "step": 1}])
    path = run / name
    rest = path.read_text() if path.is_file() else ""
    path.write_text(json.dumps(row) + "\n" + rest)  # line 1, not the (possibly torn) last line
    code, out, err = _report(capsys, run)
    assert code == 2 and out == "", err
    assert err.strip().startswith("gyre-ray report: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_float_step_in_the_trace_is_not_truncated(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`step: 1.7` once drew as step 1 (int() in the per-task rewards); now it is named."""
    run = _run(tmp_path, [GOOD_STEP], [{**GOOD_TRACE, "step": 1.7}, GOOD_TRACE])
    code, _, err = _report(capsys, run)
    assert code == 2 and f"{run / 'trace.jsonl'}:1: step 1.7 is not an integer" in err


@pytest.mark.parametrize(
    ("summary", "note"),
    [
        ({**SUMMARY, "spans": [["cell-0", "rollout", "x", 4.0]]}, "spans[0]"),
        ({**SUMMARY, "spans": 5}, "spans 5 is not a list"),
        ({**SUMMARY, "utilisation": 3}, "utilisation 3 is not an object"),
        ({**SUMMARY, "switches": [{"direction": "x", "at_s": "y", "seconds": 1.0}]}, 'switches[0]: at_s "y"'),
        ({**SUMMARY, "steps": [{"published_at_s": "x"}]}, 'steps[0]: published_at_s "x" is not a number'),
    ],
)
def test_an_odd_summary_is_left_out_with_a_note_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture, summary: dict, note: str
) -> None:
    run = _run(tmp_path, [GOOD_STEP], [GOOD_TRACE], summary)
    code, out, err = _report(capsys, run)
    assert code == 0 and err == ""
    assert f"gyre-ray report: left out timeline.png and switches.png (summary.json: {note}" in out
    assert not (run / "report" / "timeline.png").exists() and (run / "report" / "reward.png").is_file()


def test_what_the_job_writes_still_draws_every_picture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    steps = [GOOD_STEP, {**GOOD_STEP, "step": 1, "reward_mean": None, "staleness": None}]
    trace = [GOOD_TRACE, {**GOOD_TRACE, "step": 1, "reward": None, "dropped": True, "task": 7}]
    run = _run(tmp_path, steps, trace)
    (run / "eval.jsonl").write_text(
        json.dumps({"step": 0, "reward_mean": None, "pass_rate": 0.0, "tasks": {"a": {"reward": None}}})
        + "\n"
    )
    code, _, err = _report(capsys, run)
    assert code == 0 and err == ""
    assert {p.name for p in (run / "report").glob("*.png")} == {
        "reward.png", "timeline.png", "switches.png", "staleness.png", "eval.png"
    }  # fmt: skip
