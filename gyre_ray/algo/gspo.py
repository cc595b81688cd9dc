"""GSPO (Group Sequence Policy Optimization, Zheng et al. 2025) on padded rows and on packed trees.

Sequence ratio: s_i = exp(mean over sequence i's loss tokens of (log pi(y_t) - log pi_old(y_t))).
GSPO-token form: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose gradient is
s_i * grad log pi(y_t). Per token the objective is min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low,
1 + eps_high) A_{i,t}); the loss is its negative. With one advantage per sequence this has the same
value and gradient as the sequence-level GSPO objective min(s_i A_i, clip(s_i) A_i).

`gspo_loss` reduces padded (B, T) rows as the mean over rows of each row's token mean (the paper's
form, comparable with other implementations). `tree_gspo_loss` is the trainer's loss on packed
trees (`gyre_ray.trajectory.batching`): each selected path is a sequence, tokens are weighted so
that each execution's weights sum to 1, and the micro-batch loss is the SUM over its executions.
Summed over a step's micro-batches, the trainer must scale gradients by 1 / (executions in the
step) — `step_scale(batches)` — to train on the mean over executions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gyre_ray.trainers.batch import MicroBatch


def gspo_token_objective(
    log_probs: torch.Tensor,
    seq_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """Per-token clipped GSPO-token objective (to be maximised), broadcast over `log_probs`' shape.

    seq_log_ratio: log s_i per sequence, shaped to broadcast against log_probs (its gradient is
    stopped here). Returns min(s_it A, clip(s_it) A) with s_it = exp(sg[log s_i] + lp - sg[lp]).
    """
    token_ratio = torch.exp(seq_log_ratio.detach() + log_probs - log_probs.detach())
    clipped = torch.clamp(token_ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.minimum(token_ratio * advantages, clipped * advantages)


def _ratio_metrics(
    seq_log_ratio: torch.Tensor, live: torch.Tensor, clip_low: float, clip_high: float
) -> dict:
    lr = seq_log_ratio.detach()[live]
    if lr.numel() == 0:
        return {"sequences": 0}
    ratio = lr.exp()
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return {
        "sequences": int(lr.numel()),
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "clip_fraction": float(clipped.float().mean()),
        "clipped_sequences": int(clipped.sum()),
        "log_ratio_abs_mean": float(lr.abs().mean()),
    }


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict]:
    """GSPO loss on padded rows, one sequence per row.

    log_probs, old_log_probs, loss_mask: (B, T); advantages: (B,) or (B, T). Rows without loss
    tokens are left out of the mean over rows. Returns (loss, metrics).
    """
    if log_probs.dim() != 2 or log_probs.shape != old_log_probs.shape or log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"log_probs, old_log_probs and loss_mask must share one (B, T) shape, got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.dim() == 1 and advantages.shape[0] == log_probs.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != log_probs.shape:
        raise ValueError(f"advantages must be (B,) or (B, T), got {tuple(advantages.shape)}")
    mask = loss_mask.bool()
    weight = mask.to(log_probs.dtype)
    tokens = weight.sum(-1)
    log_ratio = torch.where(mask, log_probs - old_log_probs, torch.zeros_like(log_probs))
    seq_log_ratio = log_ratio.sum(-1) / tokens.clamp(min=1)
    objective = gspo_token_objective(log_probs, seq_log_ratio[:, None], advantages, clip_low, clip_high)
    row_mean = torch.where(mask, objective, torch.zeros_like(objective)).sum(-1) / tokens.clamp(min=1)
    live = tokens > 0
    loss = -row_mean[live].mean() if bool(live.any()) else log_probs.sum() * 0.0
    metrics = _ratio_metrics(seq_log_ratio, live, clip_low, clip_high)
    metrics["loss"] = float(loss.detach())
    metrics["tokens"] = int(tokens.sum())
    return loss, metrics


def tree_gspo_loss(
    log_probs: torch.Tensor, batch: MicroBatch, clip_low: float = 3e-4, clip_high: float = 4e-4
) -> tuple[torch.Tensor, dict]:
    """GSPO on packed trees: the SUM over the micro-batch's executions of each one's weighted mean.

    log_probs: (B, T) from `token_logprobs`; `batch.tensors` as documented in
    `gyre_ray.trajectory.batching` (loss_mask, old_logprobs, path_mask, path_weights,
    path_advantages). A path's ratio s_i uses all its loss tokens, shared ones included.
    """
    t = batch.tensors
    mask = t["loss_mask"]
    path_mask = t["path_mask"]
    weights = t["path_weights"].to(log_probs.dtype)
    old = t["old_logprobs"].to(log_probs.dtype)
    log_ratio = torch.where(mask, log_probs - old, torch.zeros_like(log_probs))  # (B, T)
    members = path_mask.to(log_probs.dtype)  # (B, K, T)
    tokens = members.sum(-1)  # (B, K)
    seq_log_ratio = (members * log_ratio[:, None, :]).sum(-1) / tokens.clamp(min=1)
    advantages = t["path_advantages"].to(log_probs.dtype)[:, :, None]
    objective = gspo_token_objective(
        log_probs[:, None, :], seq_log_ratio[:, :, None], advantages, clip_low, clip_high
    )
    loss = -(torch.where(path_mask, objective, torch.zeros_like(objective)) * weights).sum()
    metrics = _ratio_metrics(seq_log_ratio, tokens > 0, clip_low, clip_high)
    metrics["loss"] = float(loss.detach())
    metrics["loss_tokens"] = int(mask.sum())
    metrics["executions"] = batch.num_executions
    # Behaviour (engine) vs current (trainer) log-probs: 0 on-policy, up to numerics.
    metrics["logprob_gap_max"] = float(log_ratio.detach().abs().max()) if bool(mask.any()) else 0.0
    metrics.update(behaviour_sums(log_probs.detach(), old, mask))
    return loss, metrics


def behaviour_sums(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Sums over the loss tokens (each shared token once) that add up across micro-batches:
    `nll_sum` of the sampled tokens' negative behaviour log-probs (a sample estimate of the sampling
    policy's entropy) and `kl_sum` of the k3 estimate of KL(behaviour || current),
    exp(d) - 1 - d with d = log pi(y_t) - log pi_old(y_t) (unbiased, >= 0, 0 on-policy)."""
    d = torch.where(mask, log_probs - old_log_probs, torch.zeros_like(log_probs))
    k3 = torch.where(mask, d.exp() - 1.0 - d, torch.zeros_like(d))
    return {
        "nll_sum": float(-torch.where(mask, old_log_probs, torch.zeros_like(old_log_probs)).sum()),
        "kl_sum": float(k3.sum()),
    }


def counted_executions(batch: MicroBatch) -> list[str]:
    """The executions a micro-batch counts in its step's mean: those it holds, and those of advantage
    0 left out of training that it names (`gyre_ray.trajectory.pipeline`)."""
    return [*batch.meta.get("execution_ids", []), *batch.meta.get("untrained_execution_ids", [])]


def step_scale(batches: list[MicroBatch]) -> float:
    """1 / (distinct executions across a step's micro-batches, `counted_executions`): the `scale`
    for `optimizer_step`."""
    executions: set[str] = set()
    for b in batches:
        executions.update(counted_executions(b))
    if not executions:
        raise ValueError("no executions in these micro-batches; nothing to scale")
    return 1.0 / len(executions)


def make_tree_gspo_loss(cfg: Any) -> Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict]]:
    """The trainer loss_fn for the `algo` config section (`get_loss("gspo", cfg)`)."""
    clip_low, clip_high = cfg.clip_low, cfg.clip_high

    def loss_fn(log_probs: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, dict]:
        return tree_gspo_loss(log_probs, batch, clip_low, clip_high)

    return loss_fn
