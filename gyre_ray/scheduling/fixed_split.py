"""`async`: a fixed split of rollout and training cells with bounded staleness.

The first `train_cells` cells (the core included) train for the whole run, the others roll out.
Rollout cells launch executions of every batch the staleness bound allows; trainers train the
current batch as its groups end. Nothing ever switches, so neither side can lend spare capacity.
"""

from __future__ import annotations

from gyre_ray.scheduling.base import Policy, free_rollout_capacity, place_pending, register_policy
from gyre_ray.scheduling.state import Action, Role, SchedState


@register_policy
class AsyncPolicy(Policy):
    """Fixed split: cells `0 .. train_cells-1` train, the rest roll out."""

    name = "async"

    def __init__(self, train_cells: int = 1) -> None:
        if train_cells < 1:
            raise ValueError(f"async policy: train_cells must be >= 1, got {train_cells}")
        self.train_cells = train_cells

    def initial_roles(self, n_cells: int) -> list[Role]:
        if not 1 <= self.train_cells <= n_cells - 1:
            raise ValueError(
                f"async policy: train_cells={self.train_cells} must leave at least one rollout cell "
                f"and one trainer among {n_cells} cells (1 .. {n_cells - 1})"
            )
        return [Role.TRAIN if i < self.train_cells else Role.ROLLOUT for i in range(n_cells)]

    def decide(self, state: SchedState) -> list[Action]:
        return list(place_pending(state, free_rollout_capacity(state)))
