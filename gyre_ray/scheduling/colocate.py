"""`colocate`: every cell rolls out a step's executions, waits for the last, then every cell trains.

Synchronous and on-policy whatever eta says: a batch is launched only under its own version.
Per step it costs the last execution's end, one switch to training, the batch's training work
spread over all cells, the optimizer step and one switch back, and nothing else (no migrations,
no weight sync: trainers hold the new weights when they switch back).
"""

from __future__ import annotations

from gyre_ray.scheduling.base import EPS, Policy, free_rollout_capacity, place_pending, register_policy
from gyre_ray.scheduling.state import Action, Role, SchedState, SwitchToRollout, SwitchToTrain


@register_policy
class ColocatePolicy(Policy):
    """All cells roll out, then all cells train."""

    name = "colocate"

    def decide(self, state: SchedState) -> list[Action]:
        if state.policy_version >= state.steps_total:
            return []
        batch = state.policy_version
        rollout_over = state.pending_demand.get(batch, 0.0) <= EPS and state.unended_in_trainable == 0
        if rollout_over:
            # Nothing of this batch is left to roll out: every rollout cell trains.
            return [SwitchToTrain(c.cell_id) for c in state.cells if c.role is Role.ROLLOUT and c.ready]
        actions: list[Action] = [
            SwitchToRollout(c.cell_id) for c in state.cells if c.role is Role.TRAIN and not c.return_requested
        ]
        actions.extend(place_pending(state, free_rollout_capacity(state), max_lag=0))
        return actions
