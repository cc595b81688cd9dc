"""Evaluation's pure parts: the held-out split, which steps are evaluated, fixed-seed workspace names,
the per-task score and pass rate of a round, and the flat figures wandb gets (the round on a real run
is tests/test_resume_job.py's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre_ray.config import ConfigError, load_config
from gyre_ray.envs.base import get_task_set
from gyre_ray.evaluation import (
    check_tasks_per_step,
    eval_due,
    flat_metrics,
    format_eval,
    plan_round,
    split_tasks,
    summarize,
)
from gyre_ray.observability.metrics import flatten


def test_the_held_out_tasks_are_never_trained_on() -> None:
    every = [t.task_id for t in get_task_set("toy")]
    train, held = split_tasks(load_config(None, ["run.eval_every=2", "run.eval_holdout=2"]))
    assert [t.task_id for t in held] == every[-2:] and [t.task_id for t in train] == every[:-2]
    train, held = split_tasks(load_config(None, []))  # evaluation off: training keeps every task
    assert [t.task_id for t in train] == every and held == []
    train, held = split_tasks(load_config(None, ["run.eval_every=1", "run.eval_task_set=longtail"]))
    assert [t.task_id for t in train] == every and held  # another set: training keeps its own whole


def test_holding_out_every_task_is_refused() -> None:
    with pytest.raises(ValueError, match="would leave none to train on"):
        split_tasks(load_config(None, ["run.eval_every=1", "run.eval_holdout=4"]))


def test_a_step_needing_more_tasks_than_training_has_is_refused() -> None:
    # a task twice in one step gave two executions the same id: the store refused the second mid-run
    assert len(check_tasks_per_step(load_config(None, ["run.tasks_per_step=4"]))) == 4  # toy: 4 tasks
    with pytest.raises(ConfigError, match=r"run.tasks_per_step=5 but agents.task_set 'toy' has 4 training"):
        check_tasks_per_step(load_config(None, ["run.tasks_per_step=5"]))
    held_out = ["run.tasks_per_step=3", "run.eval_every=1", "run.eval_holdout=2"]
    with pytest.raises(ConfigError, match=r"has 2 training task\(s\) after run.eval_holdout=2 held out"):
        check_tasks_per_step(load_config(None, held_out))


def test_eval_is_due_at_the_start_every_n_steps_and_at_the_end() -> None:
    assert [s for s in range(8) if eval_due(s, 3, 7)] == [0, 3, 6, 7]
    assert not any(eval_due(s, 0, 7) for s in range(8))


def test_rounds_reuse_workspace_names_so_the_toy_harness_draws_the_same_seeds(tmp_path: Path) -> None:
    tasks = get_task_set("toy")[-1:]
    first, later = plan_round(tasks, 2, 0, tmp_path), plan_round(tasks, 2, 6, tmp_path)
    assert [i.workspace.name for i in first] == [i.workspace.name for i in later]
    assert {i.execution_id for i in first}.isdisjoint(i.execution_id for i in later)
    assert len({i.workspace for i in first + later}) == 4


@dataclass
class Outcome:
    task_id: str
    reward: float
    valid: bool = True
    reason: str = ""
    detail: str = ""
    execution_id: str = "eval-x"


def test_a_round_scores_each_task_over_its_scored_executions() -> None:
    outcomes = [Outcome("a", 1.0), Outcome("a", 0.5), Outcome("b", 0.25), Outcome("b", 0.0, valid=False)]
    row = summarize(4, outcomes, threshold=1.0, version=4, version_at_end=5)
    assert row["tasks"] == {
        "a": {"reward": 0.75, "pass_rate": 0.5, "valid": 2},
        "b": {"reward": 0.25, "pass_rate": 0.0, "valid": 1},
    }
    assert (row["valid"], row["executions"]) == (3, 4)
    assert row["reward_mean"] == pytest.approx(1.75 / 3) and row["pass_rate"] == pytest.approx(1 / 3)
    flat = flat_metrics(row)
    assert flat["eval/step"] == 4 and flat["eval/a/pass_rate"] == 0.5 and flat["eval/b/reward"] == 0.25


def test_a_task_with_no_scored_execution_has_no_reward_and_the_round_says_why() -> None:
    """A round whose agents all crashed read `greeting 0.000`, like a scored zero, with no reason."""
    crashed = "harness exited with code 1: PermissionError: answer.txt"
    outcomes = [Outcome("greeting", 0.0, valid=False, reason=crashed)] * 2 + [Outcome("b", 0.5)]
    row = summarize(1, outcomes, threshold=1.0, version=1, version_at_end=1)
    assert row["tasks"]["greeting"] == {"reward": None, "pass_rate": 0.0, "valid": 0}
    assert row["dropped"] == 2 and row["drop_reasons"] == {"harness exited with code 1": 2}
    line = format_eval(row)
    assert "per task: b 0.500, greeting n/a" in line and "dropped: harness exited with code 1 x2" in line


def test_every_number_of_a_step_reaches_wandb_flattened() -> None:
    step = {"loss": 0.5, "staleness": {"max": 1, "mean": 0.5}, "trained_by_cell": {"cell-0": 3},
            "switches": [{"cell": "cell-0"}], "skipped": "no update", "exact": True}  # fmt: skip
    assert flatten(step) == {
        "loss": 0.5, "staleness/max": 1, "staleness/mean": 0.5, "trained_by_cell/cell-0": 3, "exact": 1,
    }  # fmt: skip


def test_an_evaluation_whose_executors_keep_dying_is_abandoned_not_the_run(tmp_path, capsys) -> None:
    """`MAX_STARTS` starts of an evaluation execution used to raise out of `poll`, through the driver,
    and end the training run: the round is dropped with a warning instead."""
    from gyre_ray.evaluation import EvalRunner, _Round
    from gyre_ray.runtime.runners import ExecutorLostError

    runner = EvalRunner.__new__(EvalRunner)
    runner.rounds, runner.done_steps, runner.run_dir = [_Round(4, 4, [], [], [])], set(), tmp_path
    runner.proxy = None

    def lost(rnd) -> None:
        raise ExecutorLostError("execution r4.eval-4-t-0 lost its executor (runner-1) 5 times")

    runner._start_lost_again = lost
    assert runner.poll(5) == [] and runner.rounds == [] and 4 in runner.done_steps
    err = capsys.readouterr().err
    assert "the evaluation round after step 4 is abandoned" in err and "5 times" in err
    assert not (tmp_path / "eval.jsonl").exists()


def test_an_evaluation_waits_for_a_restarting_executor_without_blocking_poll(
    tmp_path, monkeypatch, capsys
) -> None:
    """An evaluation execution whose executor died is registered again at once and starts when that
    executor answers a probe (asked every `RUNNER_PROBE_EVERY_S`); `poll` returns meanwhile instead of
    blocking the driver on Ray's restart. One whose executor is not back within
    `EXECUTOR_BACK_WITHIN_S` abandons its round, and the round's executions are finished in the
    store (keys revoked), the lost one's and the one waiting to start again."""
    from types import SimpleNamespace

    import ray
    from ray.exceptions import ActorUnavailableError

    from gyre_ray import evaluation
    from gyre_ray.agents.relaunch import relaunch_id
    from gyre_ray.evaluation import EvalItem, EvalRunner, _Round
    from gyre_ray.runtime.runners import EXECUTOR_BACK_WITHIN_S

    answers: dict[str, object] = {"dead": ActorUnavailableError("restarting", None)}

    def get(ref, **_):
        if isinstance(ref, list):  # the store's answers to `finish_execution`
            return [None for _ in ref]
        if isinstance(answers[ref], Exception):
            raise answers[ref]
        return answers[ref]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, **_: ([r for r in refs if r in answers], []))
    monkeypatch.setattr(evaluation, "register_again", lambda _s, eid, _m, _n: (relaunch_id(eid), "k-" + eid))
    probes: list[str] = []
    executor = SimpleNamespace(
        node_ip=SimpleNamespace(remote=lambda: probes.append("p") or f"probe-{len(probes)}")
    )
    finished: list[str] = []
    store = SimpleNamespace(finish_execution=SimpleNamespace(remote=finished.append))
    runner = EvalRunner.__new__(EvalRunner)
    runner.executors, runner.store, runner.done_steps, runner.run_dir = [executor], store, set(), tmp_path
    runner.proxy = None
    started: list[tuple[str, str]] = []
    runner._execute = lambda item, key, _e: (
        started.append((item.execution_id, key)) or "ref-" + item.execution_id
    )

    def round_of(step: int) -> _Round:
        item = EvalItem(f"eval-{step}-t-0", "t", tmp_path / f"eval-{step}" / "eval-t-0")
        return _Round(step, step, [item], ["dead"], [0])

    rnd = round_of(0)
    runner.rounds = [rnd]
    assert runner.poll(0) == [] and started == [] and probes == ["p"]  # registered again, not started
    assert rnd.waiting[0].item.workspace.name == "r1.eval-t-0" and rnd.waiting[0].key == "k-eval-0-t-0"
    assert "eval-0-t-0 lost its executor; it starts again as r1.eval-0-t-0 once evaluation executor 0" in (
        capsys.readouterr().err
    )
    answers["probe-1"] = ActorUnavailableError("restarting", None)
    assert runner.poll(0) == [] and started == [] and rnd.waiting[0].probe is None  # asked again later
    rnd.waiting[0].due = 0.0
    runner.poll(0)
    answers["probe-2"] = "10.0.0.1"
    assert runner.poll(0) == [] and started == [("r1.eval-0-t-0", "k-eval-0-t-0")]
    assert rnd.refs == ["ref-r1.eval-0-t-0"] and not rnd.waiting and rnd in runner.rounds

    late = round_of(1)
    runner.rounds = [late]
    runner.poll(0)  # its probe (probe-3) never answers
    late.waiting[0].since -= EXECUTOR_BACK_WITHIN_S + 1
    assert finished == []
    assert runner.poll(0) == [] and runner.rounds == [] and 1 in runner.done_steps and len(started) == 1
    assert "evaluation executor 0 did not come back within 300 s" in capsys.readouterr().err
    assert finished == ["eval-1-t-0", "r1.eval-1-t-0"]  # the lost one (again) and the one never started
