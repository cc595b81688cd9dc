"""Rollout cells: a placement group per cell with one actor hosting a rollout engine (`RolloutCell`, `CellPool`)."""
