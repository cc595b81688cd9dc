"""`gyre-ray report`: the pictures and page of a run folder, and the numbers they are drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.observability.report import (
    ReportError,
    load_run,
    rewards_by_task,
    running_over_time,
    step_rewards_by_task,
    task_rewards,
    write_report,
)

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
    assert "nothing to draw: no metrics.jsonl, trace.jsonl, summary.json" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "rew')  # killed before its first step ended
    assert main(["report", str(tmp_path)]) == 2
    assert "nothing to draw yet: metrics.jsonl holds no step" in capsys.readouterr().err
    with pytest.raises(ReportError, match="is not a folder"):
        write_report(tmp_path / "nope")


PNG = b"\x89PNG\r\n\x1a\n"


def test_a_torn_last_line_is_skipped_and_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A killed job leaves its JSONL files with a cut-off last line: the report draws the rest."""
    run = _run_dir(tmp_path)
    for name in ("metrics.jsonl", "trace.jsonl"):
        with open(run / name, "a") as fh:
            fh.write('{"step": 2, "reward_m')
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "skipped the cut-off last line of metrics.jsonl" in out
    assert "skipped the cut-off last line of trace.jsonl" in out
    page = (run / "report" / "index.html").read_text()
    assert page.count("<tr>") == 3 and 'src="timeline.png"' in page


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _run_dir(tmp_path)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "{oops", rows[1]]) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}:2: not a JSON line" in err and len(err.strip().splitlines()) == 1
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "[1, 2]", rows[1]]) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not a JSON object"):
        write_report(run)


@pytest.mark.parametrize("summary", ["", '{"steps": [{"step": 0', "[]"])
def test_an_empty_or_torn_summary_counts_as_absent(tmp_path: Path, summary: str) -> None:
    run = _run_dir(tmp_path)
    (run / "summary.json").write_text(summary)
    loaded = load_run(run)
    assert loaded["summary"] is None
    assert loaded["notes"][0] == (
        "left out timeline.png and switches.png (summary.json is empty or cut off: the run did not finish)"
    )
    index = write_report(run)
    assert {p.name for p in index.parent.iterdir()} == {
        "index.html", "reward.png", "staleness.png", "eval.png"
    }  # fmt: skip
    assert "summary.json is empty or cut off" in index.read_text()


def test_a_crashed_run_gets_the_pictures_its_metrics_allow(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No summary.json, no trace.jsonl (a killed job): reward per step and task, staleness, evaluation."""
    run = _run_dir(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{**m, "reward_by_task": {"vowels": m["reward_mean"]}} for m in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    (run / "summary.json").unlink()
    (run / "trace.jsonl").unlink()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "gyre-ray report: left out timeline.png and switches.png (no summary.json: the run did not finish)"
    )
    report = run / "report"
    assert {p.name for p in report.iterdir()} == {"index.html", "reward.png", "staleness.png", "eval.png"}
    assert all((report / n).read_bytes()[:8] == PNG for n in ("reward.png", "staleness.png", "eval.png"))
    assert (report / "index.html").read_text().count("<tr>") == 3
    assert step_rewards_by_task(rows) == {"vowels": {0: 0.6, 1: 0.9}}  # the per-task lines without a trace


def test_out_writes_the_report_elsewhere(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _run_dir(run)
    out = tmp_path / "pictures" / "of-run"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert f"gyre-ray report: {out / 'index.html'}" in capsys.readouterr().out
    assert (out / "reward.png").read_bytes()[:8] == PNG and not (run / "report").exists()
    assert main(["report", str(run), "--out", str(run / "summary.json")]) == 2
    assert "summary.json is not a folder" in capsys.readouterr().err


def _eval_round(step: int, reward: float) -> str:
    return json.dumps({"step": step, "reward_mean": reward, "pass_rate": 0.0, "tasks": {}}) + "\n"


def test_the_newest_gyre_ray_eval_is_drawn_when_the_run_has_no_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _run_dir(tmp_path)
    for stamp, reward in (("20261206-020000", 0.1), ("20261206-030000", 0.7), ("20261206-010000", 0.2)):
        (run / "evals" / stamp).mkdir(parents=True)
        (run / "evals" / stamp / "eval.jsonl").write_text(_eval_round(2, reward))
    (run / "evals" / "20261206-040000").mkdir()  # a round that never ended: no eval.jsonl
    assert [r["reward_mean"] for r in load_run(run)["eval"]] == [0.7]
    assert main(["report", str(run)]) == 0
    assert (
        "gyre-ray report: eval.png from evals/20261206-030000/eval.jsonl "
        "(the run itself has no evaluation round)" in capsys.readouterr().out
    )
    (run / "eval.jsonl").write_text(_eval_round(0, 0.3))  # the run's own rounds come first
    loaded = load_run(run)
    assert [r["reward_mean"] for r in loaded["eval"]] == [0.3] and loaded["notes"] == []


def test_per_task_rewards_take_the_steps_the_trace_lacks_from_the_metrics() -> None:
    """A resumed segment in progress (or killed) has trace rows of the earlier segments only: the
    per-task lines ended there while the mean went on."""
    steps = [{"step": 0, "reward_by_task": {"vowels": 0.1}}, {"step": 1, "reward_by_task": {"vowels": 0.2}},
             {"step": 2, "reward_by_task": {"vowels": 0.8, "brackets": 0.4}}]  # fmt: skip
    assert task_rewards(TRACE, steps) == {
        "vowels": {0: pytest.approx(0.6), 1: 0.9, 2: 0.8},  # the trace's where it has the step
        "brackets": {2: 0.4},
    }
    assert task_rewards([], steps) == step_rewards_by_task(steps)  # a killed run has no trace
