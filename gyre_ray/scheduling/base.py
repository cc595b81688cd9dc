"""Policy interface, the registry of policies by name, and placement helpers they share.

A policy is a small object with knobs set at construction and no other state: `decide(state)`
reads a `SchedState` and returns actions; the same state always yields the same actions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

from gyre_ray.scheduling.state import Action, Launch, Role, SchedState

EPS = 1e-9


class Policy(ABC):
    """A pure scheduling policy: roles at start, then `decide(state) -> actions` at every event."""

    name: ClassVar[str]

    def initial_roles(self, n_cells: int) -> list[Role]:
        """Role of each cell at time 0 (taken without a switch cost). Default: all roll out."""
        return [Role.ROLLOUT] * n_cells

    @abstractmethod
    def decide(self, state: SchedState) -> list[Action]:
        """Actions to apply now; must not mutate `state`."""


def place_pending(
    state: SchedState,
    free: dict[int, float],
    max_lag: int | None = None,
    skip: Collection[int] = (),
    placed: dict[int, list[float]] | None = None,
) -> list[Launch]:
    """Launch pending executions, oldest batch first, each on the rollout cell with the most room.

    `free` maps ready rollout cell ids to free capacity and is updated in place. Stops at the first
    execution whose batch is not launchable (lag above `max_lag`, default eta) or that fits nowhere
    (first-in first-out: a big execution is not overtaken by small ones). Executions in `skip`
    (already launched by this decision) are passed over. If `placed` is given, the demand of each
    launch is appended to `placed[cell_id]`.
    """
    lag = state.staleness if max_lag is None else min(max_lag, state.staleness)
    launches: list[Launch] = []
    if not free:
        return launches
    for item in state.pending:
        if item.exec_id in skip:
            continue
        if item.batch >= state.steps_total or item.batch - state.policy_version > lag:
            break
        cell_id = max(free, key=free.__getitem__)
        if free[cell_id] + EPS < item.demand:
            break
        free[cell_id] -= item.demand
        launches.append(Launch(item.exec_id, cell_id))
        if placed is not None:
            placed.setdefault(cell_id, []).append(item.demand)
    return launches


def free_rollout_capacity(state: SchedState) -> dict[int, float]:
    """Free capacity of every ready rollout cell, by cell id."""
    return {c.cell_id: c.free_capacity for c in state.cells if c.role is Role.ROLLOUT and c.ready}


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available to `make_policy` under `cls.name`."""
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str, **knobs: Any) -> Policy:
    """Build the policy registered as `name` with its knobs (unknown names list the known ones)."""
    import gyre_ray.scheduling.policies  # noqa: F401  (registers the built-in policies)

    if name not in _REGISTRY:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**knobs)


def policy_names() -> list[str]:
    """Names of the registered policies."""
    import gyre_ray.scheduling.policies  # noqa: F401

    return sorted(_REGISTRY)
