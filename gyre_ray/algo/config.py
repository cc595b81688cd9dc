"""Config section `algo`: the policy-gradient objective."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class AlgoSection(Section):
    """GSPO settings (defaults follow the GSPO paper and the reference design)."""

    name: Literal["gspo"] = Field("gspo", description="Objective, looked up by name in gyre_ray.algo.")
    group_size: int = Field(
        16,
        ge=2,
        description="Executions per task whose rewards form one group (at least 2: advantages are relative "
        "within a group, so a group of one has advantage 0 and trains nothing).",
    )
    clip_low: float = Field(
        3e-4, ge=0, lt=1, description="Lower clip range of the sequence importance ratio (1 - clip_low)."
    )
    clip_high: float = Field(
        4e-4, ge=0, description="Upper clip range of the sequence importance ratio (1 + clip_high)."
    )
    normalize_std: bool = Field(
        True, description="Divide group-centred rewards by the group's standard deviation."
    )
    advantage_eps: float = Field(
        1e-6, gt=0, description="Added to the group standard deviation before dividing."
    )
    train_zero_advantage: bool = Field(
        False,
        description="Also run forward and backward on executions whose advantage is 0 (a group whose "
        "rewards are all equal). Their gradient is exactly zero, so by default they are not trained; "
        "they still count in the step's mean over executions, so the update is the same.",
    )
