"""What a scheduling policy sees and what it may decide: backend-neutral, typed, read-only.

A policy is a pure function `decide(state) -> list[Action]`. The discrete-event simulator
(`gyre_ray.sim`) and the Ray scheduler actor both build a `SchedState` from what they observe and
apply the returned actions, so what the simulator measures is the code that runs.

Vocabulary
- **cell**: a group of devices that is either a rollout engine or a trainer replica at a time.
  Cell 0 is the *core* (authoritative weights, optimizer state); the others are *satellites*.
- **execution**: one agent run of a task. Batch `b` is the set of executions whose gradients make
  update `b`, which turns policy version `b` into `b + 1`. An execution occupies `demand` units of
  the rollout capacity of the cell that hosts it, from launch to end.
- **staleness bound eta**: an execution of batch `b` may be launched only while the published
  version `v` satisfies `b - v <= eta`, so every token it produces lags its update by at most eta
  versions. eta = 0 is on-policy.
- **training work**: cell-seconds of forward/backward for a batch, queued when a group of
  executions has ended. Only the batch equal to the current version is trainable; trainer cells
  claim it in micro-steps (the backend does the claiming, the policy decides roles).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Role(str, Enum):
    """The role a cell has, or is switching to."""

    ROLLOUT = "rollout"
    TRAIN = "train"


@dataclass(frozen=True, slots=True)
class CellState:
    """One cell as the scheduler sees it.

    role: the role the cell has; while `switching_until` is set it is moving *into* that role and
        can neither host executions nor train until then.
    rollout_capacity: demand units the cell can host in the rollout role.
    load: demand units of the executions it hosts now (0 for a trainer).
    n_executions: number of executions it hosts.
    micro_step_until: end of the training micro-step in progress (None when not training one).
    return_requested: a switch back to rollout is queued and happens when the micro-step ends.
    """

    cell_id: int
    role: Role
    rollout_capacity: float
    load: float = 0.0
    n_executions: int = 0
    switching_until: float | None = None
    micro_step_until: float | None = None
    return_requested: bool = False

    @property
    def is_core(self) -> bool:
        return self.cell_id == 0

    @property
    def ready(self) -> bool:
        """True when the cell is not in the middle of a role switch."""
        return self.switching_until is None

    @property
    def free_capacity(self) -> float:
        """Demand units a ready rollout cell can still take (0 for any other cell)."""
        if self.role is not Role.ROLLOUT or not self.ready:
            return 0.0
        return max(0.0, self.rollout_capacity - self.load)


@dataclass(frozen=True, slots=True)
class Execution:
    """An execution in flight on `cell_id` (launched at `launched_at` under version `launch_version`)."""

    exec_id: int
    batch: int
    demand: float
    cell_id: int
    launched_at: float
    launch_version: int
    group: int = -1  # the task (GSPO group) it runs; -1 = not known to the backend


@dataclass(frozen=True, slots=True)
class PendingExecution:
    """An execution of `batch` not launched yet."""

    exec_id: int
    batch: int
    demand: float
    group: int = -1  # the task (GSPO group) it runs; -1 = not known to the backend


@dataclass(frozen=True, slots=True)
class EndedExecution:
    """How an execution of a task ended: seconds from launch to end, and whether it hit the timeout."""

    ran_s: float
    timed_out: bool


@dataclass(frozen=True, slots=True)
class Launch:
    """Start a pending execution on a ready rollout cell with room for its demand."""

    exec_id: int
    cell_id: int


@dataclass(frozen=True, slots=True)
class SwitchToTrain:
    """Move a ready rollout cell to training; its executions migrate to the other rollout cells."""

    cell_id: int


@dataclass(frozen=True, slots=True)
class SwitchToRollout:
    """Move a trainer cell back to rollout, after its current micro-step if one is running."""

    cell_id: int


Action = Launch | SwitchToTrain | SwitchToRollout


class ReadOnlySequence(Sequence):
    """A read-only view of a list or of a mapping's values, so a policy cannot mutate backend state."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence | Mapping) -> None:
        self._items = items

    def _values(self):
        return self._items.values() if isinstance(self._items, Mapping) else self._items

    def __iter__(self) -> Iterator:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Any:  # O(n) for mapping-backed views; policies iterate instead
        return list(self._values())[index]


@dataclass(frozen=True)
class SchedState:
    """Everything a policy may read at one decision point.

    now: seconds since the run started.
    policy_version: version of the latest published weights (= number of updates done).
    steps_total: updates the run will make; batches are 0 .. steps_total - 1.
    staleness: eta, the bound described in the module docstring.
    cells: every cell in the run, in cell id order (a backend leaves out the cells it lost for good,
        so a cell's position need not be its id).
    in_flight: executions running now, by exec id.
    in_flight_by_cell: the same executions grouped by the id of the cell that hosts them.
    pending: executions not launched yet, oldest batch first.
    pending_demand: total demand of the pending executions of each batch (absent = 0).
    ready_work_s: trainable (batch == policy_version) training work queued and not yet claimed,
        in cell-seconds.
    unended_in_trainable: executions of the trainable batch that have not ended yet (launched or not).
    updating: the optimizer step of the trainable batch is in progress.
    switch_to_train_s / switch_to_rollout_s: expected cost of a role switch (measured or configured).
    queued_demand: demand the rollout cells hold but cannot serve now, in capacity units (a real
        backend: model calls queued beyond its engines' slots, converted to executions); the
        simulator never overfills a cell, so 0 there. Elastic counts it as demand to bring cells back.
    group_ended: per task (group id), how its ended executions ended, in end order;
    group_running: per task, the launch times of its executions in flight, by exec id;
    pending_by_group: per task with executions not launched yet, those executions by exec id, tasks
        in `pending` order. All three are empty where the backend does not track tasks (then
        `launch_order="sibling"` is FIFO); the last is an index a backend may leave out (the order
        is then derived from `pending`).
    in_flight_demand_by_batch: total demand of the executions in flight of each batch (absent = 0),
        an index a backend may leave out (None: derived from `in_flight`).
    """

    now: float
    policy_version: int
    steps_total: int
    staleness: int
    cells: tuple[CellState, ...]
    in_flight: Mapping[int, Execution]
    in_flight_by_cell: Mapping[int, Mapping[int, Execution]]
    pending: Sequence[PendingExecution]
    pending_demand: Mapping[int, float]
    ready_work_s: float
    unended_in_trainable: int
    updating: bool = False
    switch_to_train_s: float = 8.52
    switch_to_rollout_s: float = 3.46
    queued_demand: float = 0.0
    group_ended: Mapping[int, Sequence[EndedExecution]] = field(default_factory=dict)
    group_running: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    pending_by_group: Mapping[int, Mapping[int, PendingExecution]] = field(default_factory=dict)
    in_flight_demand_by_batch: Mapping[int, float] | None = None

    def launchable(self, batch: int) -> bool:
        """Whether an execution of `batch` may be launched now without exceeding the staleness bound."""
        return batch < self.steps_total and batch - self.policy_version <= self.staleness

    def launchable_demand(self, max_lag: int | None = None) -> float:
        """Pending demand of every batch launchable now (lag up to `max_lag`, default eta)."""
        lag = self.staleness if max_lag is None else min(max_lag, self.staleness)
        last = min(self.steps_total - 1, self.policy_version + lag)
        return sum(self.pending_demand.get(b, 0.0) for b in range(self.policy_version, last + 1))

    def in_flight_demand(self, through_batch: int) -> float:
        """Demand of the executions in flight whose batch is at most `through_batch`."""
        if self.in_flight_demand_by_batch is not None:
            return sum(d for b, d in self.in_flight_demand_by_batch.items() if b <= through_batch)
        return sum(e.demand for e in self.in_flight.values() if e.batch <= through_batch)

    def cells_in(self, role: Role) -> list[CellState]:
        """Cells that have, or are switching to, `role`."""
        return [c for c in self.cells if c.role is role]
