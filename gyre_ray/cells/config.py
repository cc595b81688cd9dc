"""Config section `cells`: how many cells the run has, what each one reserves and how they spread over nodes."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section

HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node 1 of it


class CellsSection(Section):
    """The run's cells: one placement group, one bundle {"CPU": cpus, "GPU": gpus} per cell."""

    num_cells: int = Field(2, ge=1, description="Cells the runtime starts (cell-0 is the core).")
    cpus_per_cell: float = Field(1.0, gt=0, description="CPUs in each cell's placement-group bundle.")
    gpus_per_cell: float = Field(
        0.0, ge=0, description="GPUs in each cell's placement-group bundle (0 on a CPU machine)."
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement strategy of the cells' placement group: PACK fills few nodes, "
        "SPREAD puts cells on different nodes where it can, STRICT_SPREAD one cell per node.",
    )
    control_on_head: bool = Field(
        True,
        description="Run the store, the scheduler, the workers actor and the proxy replicas on the head "
        "node (Ray's node:__internal_head__ resource); the cells go where their placement group puts them.",
    )
    capacity: int = Field(
        0,
        ge=0,
        description="Executions one rollout cell carries at once (the scheduler's slots); "
        "0 = ceil(agents.max_parallel / num_cells).",
    )

    def control_resources(self) -> dict[str, float]:
        """Resources the run's control actors ask for: a sliver of the head node's marker resource."""
        return {HEAD_RESOURCE: 0.001} if self.control_on_head else {}

    def bundle(self) -> dict[str, float]:
        """The one bundle of each cell's placement group."""
        bundle = {"CPU": float(self.cpus_per_cell)}
        if self.gpus_per_cell > 0:
            bundle["GPU"] = float(self.gpus_per_cell)
        return bundle

    def capacity_per_cell(self, max_parallel: int) -> int:
        """Executions one rollout cell carries (`capacity`, or the parallel budget spread over the cells)."""
        return self.capacity or max(1, math.ceil(max_parallel / self.num_cells))
