"""A resume puts back the trace rows of a segment killed before it wrote its trace.jsonl.

The killed segment's scheduler journal (`gyre_ray.runtime.journal`) holds each launch's trace facts
(time on the recorder's clock, execution id, group, step, start version), each end's time and
outcome, and its groups' per-execution figures; `gyre_ray.resume.lost_trace_rows` turns the
executions of the steps before the checkpoint that the segment published into `trace.jsonl` rows,
on the run's clock, and `prepare_resume` writes them after the rows the file kept. Plain Python: the
run folders are written by hand, the journal through `RunJournal`; the last test drives the
scheduler's own journal call sites with Ray's parts stood in for.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gyre_ray.agents.launch import PlannedExecution
from gyre_ray.agents.runner import ExecutionOutcome
from gyre_ray.resume import lost_trace_rows, prepare_resume
from gyre_ray.runtime.journal import RunJournal

HEADER = {"steps": 6, "first_step": 2, "tag": ""}  # the killed segment resumed the run at step 2
STATS = {
    "s2-a-0": {"calls": 3, "tokens": 120, "trajectories": 2},
    "s2-a-1": {"calls": 1, "tokens": 40, "trajectories": 0},
}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _outcome(execution_id: str, *, reward: float, valid: bool, timed_out: bool = False) -> dict[str, Any]:
    return ExecutionOutcome(
        execution_id, execution_id.split("-")[1], 0, timed_out, 1.0, reward, valid, "", ""
    ).to_dict()


def _earlier_rows() -> list[dict[str, Any]]:
    """The first segment's trace rows (steps 0 and 1, ending at 10.0 on the run's clock)."""
    return [
        {"start": 0.0, "end": 4.0, "task": "s0-a", "step": 0, "timed_out": False, "exec_id": "s0-a-0",
         "calls": 2, "tokens": 80, "trajectories": 1, "dropped": False, "version": 0, "reward": 1.0, "runner": "workers"},
        {"start": 5.0, "end": 10.0, "task": "s1-a", "step": 1, "timed_out": False, "exec_id": "s1-a-0",
         "calls": 2, "tokens": 80, "trajectories": 1, "dropped": False, "version": 1, "reward": 0.5, "runner": "workers"},
    ]  # fmt: skip


def _killed_segment(run_dir: Path) -> None:
    """The journal of a segment that ran steps 2-4 from step 2 (its clock starts at 0), published steps
    2 and 3, checkpointed step 3 and was killed while step 4 ran: it wrote no trace."""
    journal = RunJournal.begin(run_dir, HEADER, 2)
    journal.launched(0, 0, at_s=0.25, execution_id="s2-a-0", group="s2-a", step=2, version=2)
    journal.launched(1, 1, at_s=0.5, execution_id="s2-a-1", group="s2-a", step=2, version=2, runner=1)
    journal.ended(0, _outcome("s2-a-0", reward=2 / 3, valid=True), 2.5)
    journal.ended(1, _outcome("s2-a-1", reward=0.0, valid=False, timed_out=True), 3.0)
    journal.group_stats(STATS)
    journal.launched(2, 0, at_s=3.5, execution_id="s3-b-0", group="s3-b", step=3, version=2)
    journal.published(2, 3, {"step": 2, "published_at_s": 4.0})
    journal.ended(2, _outcome("s3-b-0", reward=1.0, valid=True), 5.0)
    journal.group_stats({"s3-b-0": {"calls": 2, "tokens": 50, "trajectories": 1}})
    journal.published(3, 4, {"step": 3, "published_at_s": 6.0})
    journal.launched(3, 1, at_s=6.5, execution_id="s4-a-0", group="s4-a", step=4, version=4)
    journal.close()


def _step_2_rows(offset: float) -> list[dict[str, Any]]:
    """Step 2's executions as the killed segment's recorder would have written them, moved by `offset`."""
    return [
        {"start": 0.25 + offset, "end": 2.5 + offset, "task": "s2-a", "step": 2, "timed_out": False,
         "exec_id": "s2-a-0", "calls": 3, "tokens": 120, "trajectories": 2, "dropped": False,
         "version": 2, "reward": 0.666667, "runner": "workers"},
        {"start": 0.5 + offset, "end": 3.0 + offset, "task": "s2-a", "step": 2, "timed_out": True,
         "exec_id": "s2-a-1", "calls": 1, "tokens": 40, "trajectories": 0, "dropped": True,
         "version": 2, "reward": None, "runner": "runner-1"},
    ]  # fmt: skip


def test_a_killed_segments_trace_rows_of_steps_before_the_checkpoint_come_back(tmp_path: Path) -> None:
    """The driver logged step 2 (published at 4.0 on the segment's clock, 14.5 on the run's): the rows
    move by that 10.5; steps 3 and 4 (at or after the checkpoint at step 3) stay out."""
    _jsonl(tmp_path / "trace.jsonl", _earlier_rows())
    _jsonl(
        tmp_path / "metrics.jsonl",
        [
            {"step": 0, "published_at_s": 4.5},
            {"step": 1, "published_at_s": 10.5},
            {"step": 2, "published_at_s": 14.5},
        ],
    )
    _killed_segment(tmp_path)
    assert lost_trace_rows(tmp_path, 3, _earlier_rows()) == _step_2_rows(10.5)
    moved = prepare_resume(tmp_path, 3)
    assert moved["recovered_trace"] == 2 and moved["recovered"] == []
    trace = _rows(tmp_path / "trace.jsonl")
    assert trace == _earlier_rows() + _step_2_rows(10.5)  # sorted by start
    assert not {"s3-b-0", "s4-a-0"} & {r["exec_id"] for r in trace}


def test_a_row_the_trace_holds_comes_back_never_twice(tmp_path: Path) -> None:
    """No step of the segment was logged: the offset is where the earlier segment ended (its last
    publish, step 1 at 10.5, after its trace's last end at 10.0), as for the metrics row of step 2 that
    comes back with them; a row trace.jsonl holds is not added again, and a second resume adds nothing."""
    held = _step_2_rows(10.5)[0]
    _jsonl(tmp_path / "trace.jsonl", [*_earlier_rows(), held])
    _jsonl(
        tmp_path / "metrics.jsonl", [{"step": 0, "published_at_s": 4.5}, {"step": 1, "published_at_s": 10.5}]
    )
    _killed_segment(tmp_path)
    moved = prepare_resume(tmp_path, 3)
    assert moved["recovered"] == [2] and moved["recovered_trace"] == 1
    assert _rows(tmp_path / "metrics.jsonl")[-1] == {"step": 2, "published_at_s": 14.5}
    trace = _rows(tmp_path / "trace.jsonl")
    assert trace == [*_earlier_rows(), *_step_2_rows(10.5)]
    assert prepare_resume(tmp_path, 3)["recovered_trace"] == 0
    assert _rows(tmp_path / "trace.jsonl") == trace


def test_an_execution_with_no_end_ends_at_the_segments_last_publish(tmp_path: Path) -> None:
    """As the recorder ends it (its `last_publish`): not timed out, dropped, no reward, no figures."""
    journal = RunJournal.begin(tmp_path, {**HEADER, "first_step": 0}, 0)
    journal.launched(0, 0, at_s=1.0, execution_id="s0-a-0", group="s0-a", step=0, version=0)
    journal.published(0, 1, {"step": 0, "published_at_s": 7.25})
    journal.published(1, 2, {"step": 1, "published_at_s": 9.75})
    journal.close()
    assert lost_trace_rows(tmp_path, 2, []) == [
        {"start": 1.0, "end": 9.75, "task": "s0-a", "step": 0, "timed_out": False, "exec_id": "s0-a-0",
         "calls": 0, "tokens": 0, "trajectories": 0, "dropped": True, "version": 0, "reward": None,
         "runner": "workers"},
    ]  # fmt: skip


def test_an_old_journal_recovers_no_trace_and_still_replays(tmp_path: Path) -> None:
    """A journal written before launches carried their trace facts: no row, trace.jsonl as it was, the
    metrics row still comes back, and a restarted scheduler replays it as before."""
    journal = RunJournal.begin(tmp_path, HEADER, 2)
    journal.launched(0, 1)
    journal.ended(0, _outcome("s2-a-0", reward=1.0, valid=True))
    journal.group_stats(STATS)
    journal.published(2, 3, {"step": 2, "published_at_s": 4.0})
    journal.close()
    _jsonl(tmp_path / "trace.jsonl", _earlier_rows())
    _jsonl(
        tmp_path / "metrics.jsonl", [{"step": 0, "published_at_s": 4.5}, {"step": 1, "published_at_s": 10.5}]
    )
    assert lost_trace_rows(tmp_path, 3, _earlier_rows()) == []
    moved = prepare_resume(tmp_path, 3)
    assert moved["recovered_trace"] == 0 and moved["recovered"] == [2]
    assert _rows(tmp_path / "trace.jsonl") == _earlier_rows()
    state = RunJournal.replay(tmp_path, HEADER)
    assert state is not None and state.launched == {0: 1} and state.launches == {} and state.ended_at == {}
    assert state.outcomes[0]["reward"] == 1.0


def test_a_new_journal_replays_as_an_old_one_did(tmp_path: Path) -> None:
    """The trace facts ride along: a restarted scheduler's replay reads the same launches (-> cell),
    outcomes and published steps; another run's header still replays nothing."""
    _killed_segment(tmp_path)
    state = RunJournal.replay(tmp_path, HEADER)
    assert state is not None and state.launched == {0: 0, 1: 1, 2: 0, 3: 1}
    assert sorted(state.outcomes) == [0, 1, 2] and state.ended_at == {0: 2.5, 1: 3.0, 2: 5.0}
    assert [p["batch"] for p in state.published] == [2, 3]
    assert state.launches[3] == {
        "at_s": 6.5,
        "execution_id": "s4-a-0",
        "group": "s4-a",
        "step": 4,
        "version": 4,
    }
    assert RunJournal.replay(tmp_path, {**HEADER, "tag": "other-"}) is None


def test_the_schedulers_journal_gives_the_rows_its_recorder_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's own launch and end (Ray's parts stood in for) journal what makes, on a first
    segment (offset 0), exactly the rows `RunRecorder.trace` writes of the published steps: same
    keys, times, rounding and meaning."""
    import ray

    from gyre_ray.runtime.recorder import RunRecorder
    from gyre_ray.runtime.scheduler import RunScheduler
    from gyre_ray.scheduling.runtime import ExecutionLedger
    from gyre_ray.scheduling.state import Launch

    task = SimpleNamespace(task_id="a")
    sched = RunScheduler.__new__(RunScheduler)
    sched.planned = [PlannedExecution(f"s{b}-a-{i}", task, f"s{b}-a") for b, i in ((0, 0), (0, 1), (1, 0))]
    sched.ledger = ExecutionLedger.planned([0, 0, 1])
    sched.recorder, sched.views, sched.running, sched.outcomes = RunRecorder(["cell-0"]), [], {}, {}
    sched.journal = RunJournal.begin(tmp_path, {"steps": 2, "first_step": 0, "tag": ""}, 0)
    sched.store = SimpleNamespace(register=SimpleNamespace(remote=lambda *args: {"api_key": "k"}))
    sched.runners = []  # every execution in `workers`
    sched._start_execution = lambda item, key, runner: (item.execution_id, runner)  # the outcome's "ref"
    sched._process_if_ended = lambda group, now: None
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    clock = iter([0.123456, 0.5, 2.3456789, 2.75, 3.14159])
    sched._now = lambda: next(clock)

    sched.trainer_version = 0
    sched._launch([Launch(0, 0)])  # at 0.123456
    sched._launch([Launch(1, 0)])  # at 0.5
    for e, reward, valid in ((0, 0.123456789, True), (1, 0.0, False)):  # at 2.3456789, 2.75
        ref = next(r for r, run in sched.running.items() if run.exec_id == e)
        outcome = ExecutionOutcome(f"s0-a-{e}", "a", 0, not valid, 2.0, reward, valid, "", "")
        monkeypatch.setattr(ray, "get", lambda refs, timeout=None, o=outcome: o)
        sched._execution_ended(ref, sched.running.pop(ref))
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    stats = {"s0-a-0": {"calls": 4, "tokens": 321, "trajectories": 3}, "s0-a-1": {"calls": 1, "tokens": 9}}
    sched.journal.group_stats(stats)  # as `_group_done` journals a group's figures
    sched.recorder.exec_stats.update(stats)
    sched.journal.published(0, 1, {"step": 0, "published_at_s": 3.0})
    sched.recorder.last_publish = 3.0
    sched.trainer_version = 1
    sched._launch([Launch(2, 0)])  # step 1, at 3.14159: not published, not recovered
    sched.journal.close()

    recorded = sched.recorder.trace(sched)
    assert [r["exec_id"] for r in recorded] == ["s0-a-0", "s0-a-1", "s1-a-0"]
    assert {r["runner"] for r in recorded} == {"workers"}  # the actor that ran each (the journal's too)
    assert lost_trace_rows(tmp_path, 1, []) == [r for r in recorded if r["step"] == 0]
    assert lost_trace_rows(tmp_path, 1, [])[0]["start"] == 0.1235 and recorded[0]["reward"] == 0.123457
