"""The toy training job with `trainer.backend=megatron`: local Ray, two dual-role cells each holding a
Megatron trainer (tensor parallel 1 inside the cell actor), the torch engine rolling out, one GSPO
update on the core, gradients from the satellite imported under HF names, weights published."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_cases import require_megatron

from gyre_ray.config import load_config
from gyre_ray.model import load_policy
from gyre_ray.model.checkpoint import read_hf_weights
from gyre_ray.train import train

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_toy_job_trains_one_step_with_the_megatron_trainer(tmp_path: Path) -> None:
    require_megatron()
    overrides = [
        f"run.run_dir={tmp_path}",
        "run.tasks_per_step=1",
        "algo.group_size=3",
        "run.wandb_mode=disabled",
        "trainer.backend=megatron",
    ]
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", overrides)
    summary = train(cfg)
    (step,) = summary["steps"]
    assert step["valid"] == 3 and step["version"] == 1 and step["micro_batches"] > 0
    assert sum(step["trained_by_cell"].values()) == step["micro_batches"]
    assert step["grad_norm"] > 0
    # The torch engine's behaviour log-probs equal the Megatron trainer's on the same weights.
    assert step["logprob_gap_max"] < 1e-4
    initial = load_policy(cfg.model)[0].state_dict()
    trained = read_hf_weights(summary["checkpoint"])
    assert trained.keys() <= initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
