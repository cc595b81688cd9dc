"""The default job learns (issue 12): on two seeds the mean reward of the last 3 steps of
`jobs/configs/learn.yaml` (what `make run` runs) exceeds that of the first 3 by at least MARGIN, while
the same job with `trainer.lr=0` stays flat within noise (Z standard errors, from its own spread).

Each run is the real job (warm-up, Ray, cells, proxy, toy harness, elastic schedule, GSPO) and takes
minutes on 2 cores, so the module is marked `long`: `make test-long` runs it, `make test` does not.
The runs share one runs root, so the lr=0 control reuses seed 0's warm-up and starts from the very
weights seed 0's RL run starts from. Every step of the job covers all four tasks, so the first 3 and
the last 3 steps compare like with like.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from gyre_ray.config import load_config
from gyre_ray.train import scored_rewards, train

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.15  # the floor: at least 0.15 absolute, last 3 steps over first 3
Z = 2.5  # "flat within noise": |trend| within 2.5 standard errors of a difference of two 3-step means


def _rewards(root: Path, *overrides: str) -> list[float]:
    cfg = load_config(
        ROOT / "jobs/configs/learn.yaml", [f"run.run_dir={root}", "run.wandb_mode=disabled", *overrides]
    )
    summary = train(cfg)
    assert len(summary["steps"]) == cfg.run.steps
    return scored_rewards(summary["steps"])  # a step whose every execution was dropped has no reward


def _trend(rewards: list[float]) -> float:
    return sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3


def _trend_noise(rewards: list[float]) -> float:
    """Standard error of `_trend` for a policy that does not change, from the run's own step-to-step
    spread: sd(step means) * sqrt(1/3 + 1/3)."""
    return statistics.stdev(rewards) * (2 / 3) ** 0.5


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("learn-runs")


@pytest.mark.parametrize("seed", [0, 1])
def test_reward_rises_over_the_run(runs_root: Path, seed: int) -> None:
    rewards = _rewards(runs_root, f"model.seed={seed}")
    print(f"seed {seed}: per-step reward {[round(r, 3) for r in rewards]}, trend {_trend(rewards):+.3f}")
    assert len(rewards) >= 6
    assert _trend(rewards) >= MARGIN, rewards


def test_learning_rate_zero_stays_flat(runs_root: Path) -> None:
    rewards = _rewards(runs_root, "model.seed=0", "trainer.lr=0")
    noise = _trend_noise(rewards)
    print(
        f"lr=0: per-step reward {[round(r, 3) for r in rewards]}, trend {_trend(rewards):+.3f} (se {noise:.3f})"
    )
    assert abs(_trend(rewards)) <= Z * noise, rewards
    assert Z * noise < MARGIN  # the learning runs' margin is beyond what chance moves a flat run by
