"""Config section `scheduler`: which scheduling policy drives the cells."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class SchedulerSection(Section):
    """Scheduling policy and its knobs (shared by the simulator and the Ray scheduler)."""

    policy: Literal["elastic", "colocate", "async"] = Field("elastic", description="Scheduling policy.")
    cells: int = Field(2, ge=1, description="Number of cells the devices are split into.")
    staleness: int = Field(1, ge=0, description="Max policy-version lag of trained tokens (eta).")
