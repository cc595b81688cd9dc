"""Group-normalised advantages: each execution's reward relative to the other executions of its task.

A_i = (r_i - mean(r_group)) / (std(r_group) + eps), the population standard deviation over the
group's executions present (dropped executions have no reward and are not in the group). A group
of one, or one whose rewards are all equal, gets advantage 0: it carries no learning signal.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

# How an execution of advantage 0 is trained: not at all (its gradient is zero), though its step's
# mean over executions counts it (`gyre_ray.trajectory.pipeline`, `algo.train_zero_advantage`).
ZERO_ADVANTAGE = "advantage 0"


def group_advantages(
    rewards: Mapping[str, float],
    group_ids: Mapping[str, Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> dict[str, float]:
    """Advantage per execution id; every execution in `rewards` needs an entry in `group_ids`."""
    groups: dict[Hashable, list[str]] = {}
    for execution_id, reward in rewards.items():
        if execution_id not in group_ids:
            raise KeyError(f"execution {execution_id!r} has a reward but no group id")
        if not math.isfinite(reward):
            raise ValueError(f"execution {execution_id!r}: reward {reward!r} is not a finite number")
        groups.setdefault(group_ids[execution_id], []).append(execution_id)
    out: dict[str, float] = {}
    for members in groups.values():
        values = [float(rewards[m]) for m in members]
        if max(values) == min(values):
            out.update(dict.fromkeys(members, 0.0))
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        scale = 1.0 / (std + eps) if normalize_std else 1.0
        for m, v in zip(members, values, strict=True):
            out[m] = (v - mean) * scale
    return out
