"""Config section `trajectory`: how an execution's call tree becomes a training sample."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class TrajectorySection(Section):
    """Path budget and selection order."""

    budget: int = Field(5, ge=1, description="Most root-to-leaf paths kept per execution.")
    tie_break: Literal["longest", "latest", "earliest"] = Field(
        "longest", description="Order among paths of equal role priority."
    )
