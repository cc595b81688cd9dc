"""Executions of advantage 0 (a group whose rewards are all equal) are not trained: their gradient is
exactly zero, so the step's update is the one that trains them, for none of their forward and backward;
they still count in the step's mean over executions (the single-trainer `step_scale` and the
runtime's streaming queue alike)."""

from __future__ import annotations

import pytest
import torch

from gyre_ray.algo.advantages import ZERO_ADVANTAGE
from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import step_scale
from gyre_ray.cells.dual_role import TrainerFactory
from gyre_ray.model.arch import ModelArgs
from gyre_ray.runtime.stream import MicroBatchStream
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pipeline import training_batches_with_stats
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

MODEL = {"preset": "tiny", "dtype": "float64", "seed": 5}
TRAINER = {"lr": 1e-3, "grad_clip": 0.0}
ALGO = {"clip_low": 0.999, "clip_high": 1e6}  # no sequence clipped: every token has a gradient
WORKLOAD = SyntheticWorkload(system_tokens=12, task_tokens=4, subagent_system_tokens=6, tool_tokens=(2, 5),
                             output_tokens=(2, 5), summary_tokens=4, turns=(2, 3), max_subagents=2,
                             vocab_size=ModelArgs.tiny().vocab_size)  # fmt: skip
# Group "even" has rewards 1, 0, 1: advantages != 0. Group "flat" has 0.5 everywhere: advantage 0.
REWARDS = {"e0": 1.0, "e1": 0.0, "e2": 1.0, "f0": 0.5, "f1": 0.5, "f2": 0.5}
GROUPS = {e: "even" if e.startswith("e") else "flat" for e in REWARDS}


def batches_of(train_zero_advantage: bool, rewards: dict[str, float] = REWARDS):
    records = {e: synthetic_execution(e, 60 + i, WORKLOAD)[0] for i, e in enumerate(rewards)}
    algo = AlgoSection(**ALGO, train_zero_advantage=train_zero_advantage)
    cfg = type(
        "Cfg", (), {"trajectory": TrajectorySection(row_tokens=64, micro_batch_tokens=64), "algo": algo}
    )()
    return training_batches_with_stats(records, rewards, GROUPS, cfg)


def update(batches: list[MicroBatch]) -> tuple[dict[str, torch.Tensor], float]:
    trainer = TrainerFactory(MODEL, TRAINER, ALGO)()
    for b in batches:
        trainer.forward_backward(b)
    grad_norm = trainer.optimizer_step(step_scale(batches))["grad_norm"]
    return trainer.state_dict(), grad_norm


def test_executions_of_advantage_0_are_left_out_and_still_counted() -> None:
    batches, stats = batches_of(train_zero_advantage=False)
    trained = {e for b in batches for e in b.meta["execution_ids"]}
    assert trained == {"e0", "e1", "e2"}
    assert batches[0].meta["untrained_execution_ids"] == ["f0", "f1", "f2"]
    assert all("untrained_execution_ids" not in b.meta for b in batches[1:])
    assert {s["execution_id"]: s["training"] for s in stats} == {
        **dict.fromkeys(("e0", "e1", "e2"), "trained"),
        **dict.fromkeys(("f0", "f1", "f2"), ZERO_ADVANTAGE),
    }
    assert step_scale(batches) == pytest.approx(1 / 6)  # the mean over all six executions
    every, _ = batches_of(train_zero_advantage=True)
    assert {e for b in every for e in b.meta["execution_ids"]} == set(REWARDS)
    assert sum(b.meta["tokens"] for b in batches) < sum(b.meta["tokens"] for b in every)


def test_the_update_is_the_one_that_trains_them() -> None:
    skipped, _ = batches_of(train_zero_advantage=False)
    every, _ = batches_of(train_zero_advantage=True)
    assert len(skipped) < len(every)
    after_skip, norm_skip = update(skipped)
    after_every, norm_every = update(every)
    assert norm_skip > 0 and norm_skip == pytest.approx(norm_every, rel=1e-10)
    start = TrainerFactory(MODEL, TRAINER, ALGO)().state_dict()
    moved = max((after_every[k] - start[k]).abs().max().item() for k in start)
    worst = max((after_skip[k] - after_every[k]).abs().max().item() for k in start)
    assert moved > 1e-6 and worst <= 1e-12 * max(1.0, moved)


def test_a_step_of_advantage_0_only_has_nothing_to_train() -> None:
    batches, stats = batches_of(False, {e: 0.5 for e in REWARDS})
    assert batches == [] and {s["training"] for s in stats} == {ZERO_ADVANTAGE}


def test_the_streaming_queue_counts_executions_no_micro_batch_holds() -> None:
    stream = MicroBatchStream()
    stream.put("ref-0", ["a", "b"])
    stream.count(["c", "a"])
    assert stream.executions() == {"a", "b", "c"} and stream.scale() == pytest.approx(1 / 3)
    stream.seal()
    with pytest.raises(RuntimeError, match="sealed"):
        stream.count(["d"])
    counted_only = MicroBatchStream()
    counted_only.count(["x"])
    counted_only.seal()
    assert counted_only.complete and counted_only.items == []  # the update then skips its step
