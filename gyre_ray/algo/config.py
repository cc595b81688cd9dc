"""Config section `algo`: the policy-gradient objective."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class AlgoSection(Section):
    """GSPO settings (defaults follow the GSPO paper and the reference design)."""

    name: Literal["gspo"] = Field("gspo", description="Objective.")
    group_size: int = Field(16, ge=1, description="Executions per task whose rewards form one group.")
    clip_low: float = Field(3e-4, ge=0, description="Lower clip range of the sequence importance ratio.")
    clip_high: float = Field(4e-4, ge=0, description="Upper clip range of the sequence importance ratio.")
