"""Per-step policy metrics and the `words` task set: the loss's behaviour sums (sampled-token NLL, k3 KL,
clipped sequences) are right on and off policy, the recorder turns summed micro-batch metrics into a
step's means, rewards are kept per task, the reward trend line compares first and last steps, and the
`words` evaluator scores the share of the task's words."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gyre_ray.algo.gspo import behaviour_sums
from gyre_ray.envs.base import get_task_set
from gyre_ray.envs.words import WORD_POOL, word_share_evaluator
from gyre_ray.runtime.recorder import policy_metrics, rewards_by_task
from gyre_ray.train import format_step, reward_trend, scored_rewards


def test_behaviour_sums_on_and_off_policy() -> None:
    old = torch.tensor([[-1.0, -2.0, -3.0, -9.0]])
    mask = torch.tensor([[True, True, True, False]])
    on = behaviour_sums(old.clone(), old, mask)
    assert on["nll_sum"] == pytest.approx(6.0)  # the masked-out token is not counted
    assert on["kl_sum"] == pytest.approx(0.0, abs=1e-7)
    shifted = old + torch.tensor([[0.5, -0.5, 0.0, 4.0]])
    off = behaviour_sums(shifted, old, mask)
    expected = sum(math.exp(d) - 1 - d for d in (0.5, -0.5, 0.0))
    assert off["kl_sum"] == pytest.approx(expected, rel=1e-5)
    assert off["nll_sum"] == pytest.approx(6.0)  # of the behaviour policy, which sampled the tokens


def test_policy_metrics_are_token_and_sequence_weighted_over_micro_batches() -> None:
    sums = {"nll_sum": 30.0, "kl_sum": 0.3, "loss_tokens": 10.0, "sequences": 8.0, "clipped_sequences": 2.0}
    m = policy_metrics(sums)
    assert m == pytest.approx({"nll_mean": 3.0, "kl_behaviour": 0.03, "clip_fraction": 0.25})
    assert policy_metrics({}) == {}


def test_rewards_by_task_and_trend() -> None:
    assert rewards_by_task([("a", 1.0), ("b", 0.0), ("a", 0.5)]) == {"a": 0.75, "b": 0.0}
    steps = [{"reward_mean": r} for r in (0.2, 0.3, 0.25, 0.4, 0.5, 0.6)]
    line = reward_trend(steps)
    assert "first 3 step(s) 0.250 -> last 3 step(s) 0.500 (+0.250)" in line
    assert line.endswith("per step 0.20 0.30 0.25 0.40 0.50 0.60")
    assert "first 1 step(s) 0.200" in reward_trend(steps[:1])
    assert "first 1 step(s) 0.200 -> last 1 step(s) 0.250" in reward_trend(steps[:3])  # windows apart


def test_a_step_that_scored_nothing_has_no_reward_and_says_why() -> None:
    """A step whose every execution was dropped (a harness that could not start) is not a reward of 0:
    the trend leaves it out, the step line says n/a and why."""
    steps = [{"reward_mean": r} for r in (0.2, 0.3, None, 0.25, 0.4, 0.5, 0.6)]
    assert scored_rewards(steps) == [0.2, 0.3, 0.25, 0.4, 0.5, 0.6]
    line = reward_trend(steps)
    assert "first 3 step(s) 0.250 -> last 3 step(s) 0.500 (+0.250)" in line
    assert line.endswith("per step 0.20 0.30 n/a 0.25 0.40 0.50 0.60")
    assert reward_trend([{"reward_mean": None}]) == "reward trend: no scored steps"
    empty = {
        "valid": 0, "executions": 16, "timed_out": 0, "reward_mean": None, "calls": 0, "paths_selected": 0,
        "paths_total": 0, "tokens_expanded_all": 0, "tokens_packed_selected": 0, "loss_tokens": 0,
        "drop_reasons": {"no model calls": 16},
    }  # fmt: skip
    assert "0/16 executions scored (timeouts 0), reward n/a [dropped: 16 no model calls]" in format_step(
        empty
    )
    recovered = {"step": 3, "recovered_after_scheduler_restart": True}  # all a restarted scheduler knows
    assert "metrics were lost" in format_step(recovered)
    fitted = {"executions": 30, "mu_log_hours": -5.8263, "sigma_log_hours": 0.3802, "rho": 0.5337}
    assert format_step({**empty, "duration_model": fitted}).endswith(
        "; sibling order's duration model refitted to 30 ended executions (mu -5.826 log h, sigma 0.380, rho 0.53)"
    )
    trained = {
        **empty, "loss": 0.1, "grad_norm": 0.2, "version": 3, "logprob_gap_max": 2e-6, "overlap_s": 0.0,
        "later_executions_started": 0,
    }  # fmt: skip
    assert ", engine/trainer logprob gap 2.00e-06," in format_step(
        {**trained, "staleness": {"max": 0, "mean": 0.0}}
    )
    stale = format_step({**trained, "logprob_gap_max": 1.5, "staleness": {"max": 1, "mean": 0.5}})
    assert (
        ", behaviour/trainer logprob gap 1.50e+00 (tokens up to 1 version old: the policy moved since),"
        in stale
    )
    assert "engine/trainer" not in stale
    waiting = {**empty, "duration_model": {"error": "need at least two tasks with two or more executions"}}
    assert format_step(waiting).endswith(
        "not yet on a fitted duration model (need at least two tasks with two or more executions)"
    )


@pytest.mark.parametrize(
    ("text", "reward"),
    [("hour day hour\n", 1.0), ("hour box\nweek key\n", 0.25), ("", 0.0), ('{"text": "day"}', 0.5)],
)
def test_word_share_evaluator(tmp_path: Path, text: str, reward: float) -> None:
    (tmp_path / "answer.txt").write_text(text)
    assert word_share_evaluator(("hour", "day"))(tmp_path).reward == pytest.approx(reward)


def test_words_task_set_targets_two_pool_words(tmp_path: Path) -> None:
    tasks = get_task_set("words")
    assert len(tasks) == 4
    for task in tasks:
        assert "write_file" in task.prompt
        (tmp_path / "answer.txt").write_text(" ".join(WORD_POOL))
        assert task.evaluate(tmp_path).reward == pytest.approx(2 / len(WORD_POOL))
    assert word_share_evaluator(("hour",))(tmp_path / "missing").reward == 0.0


def test_a_switch_running_across_a_publish_is_listed_in_the_step_it_ended(monkeypatch) -> None:
    """A switch's event is kept when the switch ends, stamped with its start: one that began before a
    publish and ended after it was in neither step's `switches` (the run's list had it)."""
    from types import SimpleNamespace

    import gyre_ray.runtime.recorder as recorder
    from gyre_ray.runtime.recorder import RunRecorder
    from gyre_ray.runtime.stream import MicroBatchStream
    from gyre_ray.runtime.work import Update
    from gyre_ray.scheduling.runtime import ExecutionLedger

    monkeypatch.setattr(recorder, "outcome_metrics", lambda outcomes: {})
    rec = RunRecorder(["c0", "c1"])
    outcome = SimpleNamespace(valid=True, timed_out=False, reward=1.0, duration_s=1.0, error=None)
    streams = {0: MicroBatchStream(), 1: MicroBatchStream()}
    for stream in streams.values():
        stream.seal()
    planned = [SimpleNamespace(task=SimpleNamespace(task_id="t"))] * 2
    sched = SimpleNamespace(
        ledger=ExecutionLedger.planned([0, 1]), streams=streams, token_versions={}, planned=planned
    )
    for e in (0, 1):
        rec.launched(e, 0.0, 0)
        rec.ended(e, 1.0, outcome)
    before = {"cell": "c0", "direction": "train->rollout", "at_s": 2.0, "seconds": 1.0, "batch": 0}
    rec.switched("to_rollout", 1.0, before)  # 2 .. 3: step 0's
    first = rec.step_done(sched, Update(0, "publish", 0.0, metrics={"version": 1}, version=1), 6.0)
    across = {"cell": "c1", "direction": "rollout->train", "at_s": 5.0, "seconds": 2.0, "batch": 0}
    rec.switched("to_train", 2.0, across)  # began at 5, before step 0's publish at 6; ended at 7
    second = rec.step_done(sched, Update(1, "publish", 6.0, metrics={"version": 2}, version=2), 10.0)
    assert first["switches"] == [before] and second["switches"] == [across]
