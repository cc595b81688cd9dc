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

    def lost(rnd) -> None:
        raise ExecutorLostError("execution r4.eval-4-t-0 lost its executor (runner-1) 5 times")

    runner._start_lost_again = lost
    assert runner.poll(5) == [] and runner.rounds == [] and 4 in runner.done_steps
    err = capsys.readouterr().err
    assert "the evaluation round after step 4 is abandoned" in err and "5 times" in err
    assert not (tmp_path / "eval.jsonl").exists()
