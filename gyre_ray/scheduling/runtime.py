"""The real system seen as a `SchedState`: the pure half of the Ray scheduler loop (`gyre_ray.elastic.step`).

The loop keeps plain bookkeeping (`CellView` per cell, an `ExecutionLedger` for the step's
executions), turns it into the `SchedState` the simulator's policies read (`build_state`), calls
the *same* policy object (`policy_from_section`: elastic, colocate or async) and applies its
actions to Ray actors and the proxy. Every function here takes plain inputs and is tested without Ray.

Mapping: one execution = demand 1; a cell hosts up to `capacity` executions; the executions of the
step form batch `version` (on-policy step: `steps_total = version + 1`). The proxy routes calls by
session affinity, so which cell *hosts* an execution is the ledger's bookkeeping (the policy's
placement, and the migrations a switch implies), not the proxy's routing table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_ray.scheduling.base import Policy, make_policy
from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.scheduling.state import (
    CellState,
    Execution,
    PendingExecution,
    ReadOnlySequence,
    Role,
    SchedState,
)

TICK = 1e-3  # a switch or micro-step that overran its estimate still ends "soon"


@dataclass
class CellView:
    """One cell as the loop tracks it: role (or role it is switching to) and what it is doing."""

    cell_id: str
    index: int
    role: Role = Role.ROLLOUT
    capacity: float = 1.0
    switching_since: float | None = None  # a switch into `role` is in progress since then
    training_since: float | None = None  # a micro-step is in progress since then
    return_requested: bool = False

    @property
    def ready(self) -> bool:
        return self.switching_since is None


@dataclass
class ExecutionLedger:
    """The step's executions: pending (in plan order), hosted (exec -> cell index), ended."""

    total: int
    pending: list[int] = field(default_factory=list)
    hosted: dict[int, int] = field(default_factory=dict)
    launched_at: dict[int, float] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)

    @classmethod
    def planned(cls, count: int) -> ExecutionLedger:
        return cls(total=count, pending=list(range(count)))

    def launch(self, exec_id: int, cell: int, now: float) -> None:
        self.pending.remove(exec_id)
        self.hosted[exec_id] = cell
        self.launched_at[exec_id] = now

    def end(self, exec_id: int) -> None:
        self.hosted.pop(exec_id, None)
        self.ended.add(exec_id)

    def on_cell(self, cell: int) -> list[int]:
        return [e for e, c in self.hosted.items() if c == cell]

    @property
    def unended(self) -> int:
        return self.total - len(self.ended)


@dataclass(frozen=True)
class Costs:
    """Expected durations the policy weighs (measured as the run goes, or configured)."""

    switch_to_train_s: float = 1.0
    switch_to_rollout_s: float = 0.5
    micro_step_s: float = 1.0


def build_state(
    now: float,
    version: int,
    staleness: int,
    cells: list[CellView],
    ledger: ExecutionLedger,
    queued_micro_batches: int,
    costs: Costs,
) -> SchedState:
    """The policy's view of one on-policy step of the real system."""
    loads: dict[int, int] = {}
    for cell in ledger.hosted.values():
        loads[cell] = loads.get(cell, 0) + 1
    states = []
    for c in cells:
        switching_until = None
        if c.switching_since is not None:
            expected = costs.switch_to_train_s if c.role is Role.TRAIN else costs.switch_to_rollout_s
            switching_until = max(now + TICK, c.switching_since + expected)
        micro_until = None
        if c.training_since is not None:
            micro_until = max(now + TICK, c.training_since + costs.micro_step_s)
        load = loads.get(c.index, 0) if c.role is Role.ROLLOUT else 0
        states.append(
            CellState(
                c.index,
                c.role,
                c.capacity,
                float(load),
                load,
                switching_until,
                micro_until,
                c.return_requested,
            )
        )
    in_flight = {
        e: Execution(e, version, 1.0, cell, ledger.launched_at[e], version)
        for e, cell in ledger.hosted.items()
    }
    by_cell: dict[int, dict[int, Execution]] = {}
    for e, ex in in_flight.items():
        by_cell.setdefault(ex.cell_id, {})[e] = ex
    pending = [PendingExecution(e, version, 1.0) for e in ledger.pending]
    return SchedState(
        now=now,
        policy_version=version,
        steps_total=version + 1,
        staleness=staleness,
        cells=tuple(states),
        in_flight=in_flight,
        in_flight_by_cell=by_cell,
        pending=ReadOnlySequence(pending),
        pending_demand={version: float(len(pending))} if pending else {},
        ready_work_s=queued_micro_batches * costs.micro_step_s,
        unended_in_trainable=ledger.unended,
        switch_to_train_s=costs.switch_to_train_s,
        switch_to_rollout_s=costs.switch_to_rollout_s,
    )


def migrate_executions(ledger: ExecutionLedger, leaving: int, cells: list[CellView]) -> dict[int, int]:
    """Re-host the executions of a cell leaving rollout on the ready rollout cells with the most room.

    Mirrors the policy's own migration rule; returns {exec_id: new cell index}. Executions that fit
    nowhere stay booked on the leaving cell's best alternative anyway (the proxy still serves them).
    """
    others = [c for c in cells if c.role is Role.ROLLOUT and c.ready and c.index != leaving]
    moves: dict[int, int] = {}
    if not others:
        return moves
    for exec_id in ledger.on_cell(leaving):
        room = {c.index: c.capacity - len(ledger.on_cell(c.index)) for c in others}
        target = max(room, key=room.__getitem__)
        ledger.hosted[exec_id] = target
        moves[exec_id] = target
    return moves


def policy_from_section(section: SchedulerSection, num_cells: int) -> Policy:
    """The policy object the simulator would build from the same `scheduler` section, for `num_cells` cells."""
    if section.policy == "elastic":
        return make_policy(
            "elastic", repay_factor=section.elastic_repay_factor, prefetch=section.elastic_prefetch
        )
    if section.policy == "async":
        return make_policy("async", train_cells=section.async_train_cells or max(1, num_cells // 2))
    return make_policy(section.policy)
