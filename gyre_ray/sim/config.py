"""Config section `sim`: discrete-event simulation of whole training runs."""

from __future__ import annotations

from pydantic import Field

from gyre_ray.configbase import Section


class SimSection(Section):
    """Simulator settings."""

    workload: str = Field("nl2repo", description="Workload preset name or path to a workload YAML.")
    steps: int = Field(48, ge=1, description="RL steps to simulate.")
    seed: int = Field(0, description="Random seed of the synthetic workload.")
