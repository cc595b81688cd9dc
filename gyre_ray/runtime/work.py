"""The scheduler's pending work: one small dataclass per thing in flight (which cell, what, since when).

Each is keyed in the scheduler by the Ray object ref that completes it. Times are seconds since the
run started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunningExecution:
    """An execution's harness task: launched on `cell` (the ledger's placement) under `version`, run by
    runner actor `runner` (`gyre_ray.runtime.runners`)."""

    exec_id: int
    cell: int
    since: float
    version: int
    runner: int | None = None  # its runner actor (None: `workers`)


@dataclass
class Switch:
    """A role switch of `cell`: `direction` "to_train" / "to_rollout"; `stage` 2 is the catch-up
    (load the version published meanwhile), stage 3 a returning cell's undrain once it holds the
    published version."""

    cell: int
    direction: str
    since: float
    version: int
    stage: int = 1
    event: dict[str, Any] = field(default_factory=dict)


@dataclass
class MicroStep:
    """Forward/backward of micro-batch `item` of `batch` on `cell`."""

    cell: int
    batch: int
    item: int
    since: float


@dataclass
class GroupJob:
    """The processing task of a finished group (records -> micro-batches)."""

    group: str
    batch: int
    since: float


@dataclass
class Update:
    """Update `batch` in progress: stage "grads" (satellites' sums into the core), "step" (optimizer),
    "publish" (every engine and training satellite loads the new version)."""

    batch: int
    stage: str
    since: float
    refs: set[Any] = field(default_factory=set)
    stage_since: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    weights: Any = None
    version: int = 0
    holds: set[int] = field(default_factory=set)  # cells that loaded `version` during "publish"
