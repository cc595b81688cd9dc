"""Shared cases for the Megatron trainer tests: HF Qwen3 folders (tied / untied, GQA, head_dim !=
hidden / heads), a tree-packed on-policy GSPO micro-batch from synthetic agent records, and the
comparisons. Under CI megatron-core must be installed (`make install` does it): no skipping there."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import make_tree_gspo_loss
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import save_hf
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.base import Trainer
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pipeline import build_training_batches
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_executions

VOCAB = 256


def require_megatron() -> None:
    """Skip without megatron-core, except under CI, where its absence is a failure."""
    if os.environ.get("CI"):
        import megatron.core  # noqa: F401
    else:
        pytest.importorskip("megatron.core")


def model_args(tied: bool) -> ModelArgs:
    """GQA (4 query / 2 KV heads), head_dim 16 != 48 / 4, a non-default RoPE base when untied."""
    return ModelArgs(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=1_000_000.0 if tied else 10_000.0,
        tie_word_embeddings=tied,
        eos_token_id=0,
    )


def hf_folder(tmp: Path, tied: bool, seed: int = 0) -> Path:
    """A saved HF Qwen3 folder with seeded random weights (wide init, so log-probs are far from uniform)."""
    args = model_args(tied)
    return save_hf(
        init_weights(Qwen3ForCausalLM(args), seed, std=0.2), args, tmp / f"hf-{'tied' if tied else 'untied'}"
    )


def gspo_loss():
    return make_tree_gspo_loss(AlgoSection())


def packed_batches(reference: Trainer, seed: int = 0) -> list[MicroBatch]:
    """Tree-packed micro-batches of three executions (retries, sub-agents, compaction), made on-policy:
    behaviour log-probs are `reference`'s, so the GSPO ratio is 1 (the middle execution has advantage 0
    and no gradient, packed all the same)."""
    workload = SyntheticWorkload(
        system_tokens=12, task_tokens=6, subagent_system_tokens=6, segments=(1, 2), turns=(2, 3),
        output_tokens=(3, 6), tool_tokens=(3, 6), summary_tokens=4, instruction_tokens=2,
        max_subagents=2, subagent_turns=(1, 2), retry_prob=0.5, vocab_size=VOCAB,
    )  # fmt: skip
    records = synthetic_executions(3, seed=seed, workload=workload)
    rewards = {name: float(i) for i, name in enumerate(records)}
    groups = dict.fromkeys(records, "g")
    # the middle execution's advantage is 0: packed all the same, so that the rows have the shapes
    # (an odd width among the tree rows) these cases need
    cfg = SimpleNamespace(trajectory=TrajectorySection(), algo=AlgoSection(train_zero_advantage=True))
    batches = build_training_batches(records, rewards, groups, cfg, vocab_size=VOCAB)
    for batch in batches:
        mask = batch.tensors["loss_mask"]
        current = reference.compute_logprobs(batch)
        batch.tensors["old_logprobs"] = torch.where(mask, current, torch.zeros_like(current))
    return batches


def is_tree(batch: MicroBatch) -> bool:
    """True when some token's predecessor is not the column before it (a branch in a packed tree)."""
    columns = torch.arange(batch.input_ids.size(1))
    live = batch.parent_index >= 0
    return bool((batch.parent_index[live] != (columns.expand_as(batch.parent_index) - 1)[live]).any())


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| / max|a| over tensors (same names required)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)) for k in a)


def update_relative_error(
    before: dict, after_a: dict, after_b: dict, grads: dict, min_grad: float
) -> tuple[float, float]:
    """(largest |delta_a - delta_b| / max|delta_a| over weights whose gradient exceeds `min_grad`,
    share of the gradient's squared norm on those weights).

    AdamW's first step is ~lr * g / (|g| + eps): where |g| sits at float32 rounding level (~1e-9,
    near eps) the step's size is noise in any implementation, so those elements are left out.
    """
    worst, scale, live_count, total = 0.0, 0.0, 0.0, 0.0
    for k in before:
        da, db = after_a[k] - before[k], after_b[k] - before[k]
        live = grads[k].abs() > min_grad
        g2 = grads[k].double().pow(2)
        live_count, total = live_count + float(g2[live].sum()), total + float(g2.sum())
        scale = max(scale, float(da.abs().max()))
        if bool(live.any()):
            worst = max(worst, float((da - db).abs()[live].max()))
    return worst / scale, live_count / total


def assert_trains_alike(
    reference: Trainer, trainer: Trainer, batches: list[MicroBatch]
) -> dict[str, torch.Tensor]:
    """`trainer` (ranks split some way) gives `reference`'s log-probs, losses, gradients, grad norm and
    clipped AdamW update on `batches`; returns the weights before the update (the reference's)."""
    from gyre_ray.algo.gspo import step_scale

    for batch in batches:
        assert float((trainer.compute_logprobs(batch) - reference.compute_logprobs(batch)).abs().max()) < 1e-5
    before = reference.state_dict()
    for batch in batches:
        a, b = reference.forward_backward(batch), trainer.forward_backward(batch)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
    grads1, grads2 = reference.export_grads(), trainer.export_grads()
    assert max_relative_error(grads1, grads2) < 1e-5
    assert max(float(g.abs().max()) for g in grads1.values()) > 1e-3  # there is a gradient to compare
    scale = step_scale(batches)
    m1, m2 = reference.optimizer_step(scale), trainer.optimizer_step(scale)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert trainer.version == reference.version
    error, covered = update_relative_error(
        before, reference.state_dict(), trainer.state_dict(), grads1, min_grad=1e-3
    )
    assert error < 1e-5 and covered > 0.99, (error, covered)
    return before
