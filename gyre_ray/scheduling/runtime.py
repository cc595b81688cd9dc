"""The real system seen as a `SchedState`: the pure half of the scheduler actor (`gyre_ray.runtime.scheduler`).

The actor keeps plain bookkeeping (a `CellView` per cell with its `CellPhase`, an `ExecutionLedger`
for every execution of the run, the micro-batch queue of each batch), turns it into the `SchedState`
the simulator's policies read (`build_state`), calls the *same* policy object (`policy_from_section`:
elastic, colocate or async) and applies its actions to the cells. Everything here takes plain inputs
and is tested without Ray.

Mapping: one execution = demand 1; a rollout cell carries up to `capacity` executions; the executions
of RL step b form batch b, trained into update b (version b -> b + 1); `policy_version` is the number
of updates published (every rollout engine and training replica serves it). Executions of batch b may
launch while b - policy_version <= eta (`staleness`), so several batches can be in flight at once.
Which cell *hosts* an execution is the ledger's bookkeeping (the policy's placement, and the
migrations a switch implies); the proxy routes calls by session affinity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from gyre_ray.scheduling.base import Policy, make_policy
from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.scheduling.duration_fit import FittedDurationModel, fit_duration_model
from gyre_ray.scheduling.launch_order import DurationPrior
from gyre_ray.scheduling.state import (
    CellState,
    EndedExecution,
    Execution,
    PendingExecution,
    ReadOnlySequence,
    Role,
    SchedState,
)

TICK = 1e-3  # a switch or micro-step that overran its estimate still ends "soon"


class CellPhase(str, Enum):
    """What a cell is doing: one of these at any time."""

    ROLLOUT = "rollout"  # serving the proxy
    TO_TRAIN = "to_train"  # draining, engine releasing memory, trainer loading weights
    TRAIN_IDLE = "train_idle"  # a trainer with nothing claimed
    TRAINING = "training"  # a micro-step in progress
    TO_ROLLOUT = "to_rollout"  # exporting gradients, engine resuming and loading weights
    LOST = "lost"  # died and not restarted (no pool, or restarted too often): out of the run for good

    @property
    def role(self) -> Role:
        """The role the cell has or is switching to (what the policy sees; a lost cell, which the
        policy never sees, counts as rollout, the role a restarted cell comes back in)."""
        training = (CellPhase.TO_TRAIN, CellPhase.TRAIN_IDLE, CellPhase.TRAINING)
        return Role.TRAIN if self in training else Role.ROLLOUT


@dataclass
class CellView:
    """One cell as the scheduler tracks it."""

    cell_id: str
    index: int
    capacity: float = 1.0
    phase: CellPhase = CellPhase.ROLLOUT
    since: float = 0.0  # when the current phase began (seconds since the run started)
    return_requested: bool = False
    is_core: bool = False

    @property
    def role(self) -> Role:
        return self.phase.role

    @property
    def ready(self) -> bool:
        """Not in the middle of a switch (and not lost)."""
        return self.phase not in (CellPhase.TO_TRAIN, CellPhase.TO_ROLLOUT, CellPhase.LOST)

    @property
    def lost(self) -> bool:
        """Out of the run for good (`CellPhase.LOST`): the policy never sees it, nothing is sent to it."""
        return self.phase is CellPhase.LOST

    def enter(self, phase: CellPhase, now: float) -> None:
        self.phase, self.since = phase, now


@dataclass
class ExecutionLedger:
    """Every execution of the run: pending (in launch order), hosted (exec -> cell index), ended."""

    batch_of: list[int]
    pending: list[int] = field(default_factory=list)
    hosted: dict[int, int] = field(default_factory=dict)
    launched_at: dict[int, float] = field(default_factory=dict)
    launch_version: dict[int, int] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    group_of: list[int] = field(default_factory=list)  # task index of each execution (empty: unknown)
    # per task, how its ended executions ended (kept as they end: `build_state` hands it over as is)
    ended_by_group: dict[int, list[EndedExecution]] = field(default_factory=dict)

    @classmethod
    def planned(cls, batch_of: list[int], group_of: list[int] | None = None) -> ExecutionLedger:
        """`batch_of[e]` is the batch (RL step) of execution e, `group_of[e]` its task (optional, for the
        sibling launch order); executions launch in index order."""
        if group_of is not None and len(group_of) != len(batch_of):
            raise ValueError(f"group_of has {len(group_of)} entries for {len(batch_of)} executions")
        return cls(batch_of=list(batch_of), pending=list(range(len(batch_of))), group_of=list(group_of or []))

    @property
    def total(self) -> int:
        return len(self.batch_of)

    def launch(self, exec_id: int, cell: int, now: float, version: int = 0) -> None:
        self.pending.remove(exec_id)
        self.hosted[exec_id] = cell
        self.launched_at[exec_id] = now
        self.launch_version[exec_id] = version

    def end(self, exec_id: int, ran_s: float | None = None, timed_out: bool = False) -> None:
        """Mark `exec_id` ended; `ran_s` (how long it ran) feeds its task's history when given."""
        self.hosted.pop(exec_id, None)
        self.ended.add(exec_id)
        if ran_s is not None and self.group_of:
            how = EndedExecution(max(0.0, float(ran_s)), bool(timed_out))
            self.ended_by_group.setdefault(self.group_of[exec_id], []).append(how)

    def group(self, exec_id: int) -> int:
        return self.group_of[exec_id] if self.group_of else -1

    def on_cell(self, cell: int) -> list[int]:
        return [e for e, c in self.hosted.items() if c == cell]

    def unended(self, batch: int) -> int:
        """Executions of `batch` that have not ended (launched or not)."""
        return sum(1 for e, b in enumerate(self.batch_of) if b == batch and e not in self.ended)


@dataclass(frozen=True)
class Costs:
    """Expected durations the policy weighs (measured as the run goes, or configured)."""

    switch_to_train_s: float = 1.0
    switch_to_rollout_s: float = 0.5
    micro_step_s: float = 1.0


def build_state(
    now: float,
    version: int,
    steps: int,
    staleness: int,
    cells: list[CellView],
    ledger: ExecutionLedger,
    queued_micro_batches: int,
    costs: Costs,
    updating: bool = False,
    waiting_calls: Mapping[int, int] | None = None,
) -> SchedState:
    """The policy's view of the run: `version` updates published, `steps` in all, `queued_micro_batches`
    of the trainable batch (batch `version`) waiting for a trainer. Cells lost for good are left out
    (no capacity, nothing to wait for); executions still booked on one count as `queued_demand`.

    `waiting_calls` (cell index -> model calls its engine holds beyond its decode slots, as last
    polled) feeds `queued_demand` with `queued_demand_of`."""
    loads: dict[int, int] = {}
    for cell in ledger.hosted.values():
        loads[cell] = loads.get(cell, 0) + 1
    states = []
    for c in cells:
        if c.lost:
            continue
        switching_until = None
        if not c.ready:
            expected = costs.switch_to_train_s if c.role is Role.TRAIN else costs.switch_to_rollout_s
            switching_until = max(now + TICK, c.since + expected)
        micro_until = max(now + TICK, c.since + costs.micro_step_s) if c.phase is CellPhase.TRAINING else None
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
        e: Execution(
            e,
            ledger.batch_of[e],
            1.0,
            cell,
            ledger.launched_at[e],
            ledger.launch_version.get(e, 0),
            ledger.group(e),
        )
        for e, cell in ledger.hosted.items()
    }
    by_cell: dict[int, dict[int, Execution]] = {}
    for e, ex in in_flight.items():
        by_cell.setdefault(ex.cell_id, {})[e] = ex
    pending = [PendingExecution(e, ledger.batch_of[e], 1.0, ledger.group(e)) for e in ledger.pending]
    group_running: dict[int, dict[int, float]] = {}
    if ledger.group_of:
        for e in ledger.hosted:
            group_running.setdefault(ledger.group_of[e], {})[e] = ledger.launched_at[e]
    demand: dict[int, float] = {}
    for p in pending:
        demand[p.batch] = demand.get(p.batch, 0.0) + 1.0
    return SchedState(
        now=now,
        policy_version=version,
        steps_total=steps,
        staleness=staleness,
        cells=tuple(states),
        in_flight=in_flight,
        in_flight_by_cell=by_cell,
        pending=ReadOnlySequence(pending),
        pending_demand=demand,
        ready_work_s=0.0 if updating else queued_micro_batches * costs.micro_step_s,
        unended_in_trainable=ledger.unended(version),
        updating=updating,
        switch_to_train_s=costs.switch_to_train_s,
        switch_to_rollout_s=costs.switch_to_rollout_s,
        queued_demand=queued_demand_of(cells, loads, waiting_calls or {}),
        group_ended=MappingProxyType(ledger.ended_by_group),
        group_running=group_running,
    )


def queued_demand_of(
    cells: list[CellView], loads: Mapping[int, int], waiting_calls: Mapping[int, int]
) -> float:
    """Demand (executions) the rollout side holds but cannot serve now: what elastic brings cells back for.

    - executions still booked on a cell that is not in the rollout role, or lost for good (nowhere
      to migrate to; a rollout cell's own executions, even beyond its capacity, are its `load` already);
    - model calls waiting in a ready rollout cell's engine beyond its decode slots, one execution
      each (an agent waits on its call).
    """
    queued = 0.0
    for c in cells:
        if c.role is not Role.ROLLOUT or c.lost:
            queued += loads.get(c.index, 0)
        elif c.ready:
            queued += max(0, int(waiting_calls.get(c.index, 0)))
    return queued


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


def policy_from_section(
    section: SchedulerSection, num_cells: int, fitted_prior: DurationPrior | None = None
) -> Policy:
    """The policy object the simulator would build from the same `scheduler` section, for `num_cells` cells.

    With `elastic_duration_prior: auto` the sibling order uses `fitted_prior` (the run's own fit,
    `fit_ended_durations`), first in first out until there is one.
    """
    name, knobs = policy_knobs(section, num_cells, fitted_prior)
    return make_policy(name, **knobs)


def policy_knobs(
    section: SchedulerSection, num_cells: int, fitted_prior: DurationPrior | None = None
) -> tuple[str, dict[str, Any]]:
    """The registered policy name and its knobs for a `scheduler` section (`policy_from_section`; the
    replay of a run, `gyre_ray.sim.replay`, simulates the same)."""
    if section.policy == "elastic":
        prior = fitted_prior if section.fits_duration_prior else section.duration_prior()
        return "elastic", {
            "repay_factor": section.elastic_repay_factor,
            "prefetch": section.elastic_prefetch,
            "pace_s": section.elastic_pace_s,
            "launch_order": section.elastic_launch_order if prior is not None else "fifo",
            "duration_prior": prior,
        }
    if section.policy == "async":
        return "async", {"train_cells": section.async_split(num_cells)}
    return section.policy, {}


# ended executions a refit reads at most (the latest tasks'): 0.3 s here (nl2repo, 2026-12-05)
FIT_LIMIT = 4096


def fit_ended_durations(ledger: ExecutionLedger, limit: int = FIT_LIMIT) -> FittedDurationModel:
    """The duration model fitted to the run's ended executions (the latest tasks', up to `limit`).

    ValueError (from the fit, saying why) while too few have ended to identify it.
    """
    durations: list[float] = []
    tasks: list[int] = []
    timed_out: list[bool] = []
    for group in reversed(list(ledger.ended_by_group)):
        ended = ledger.ended_by_group[group]
        if len(durations) + len(ended) > limit and durations:
            break
        for how in ended:
            if how.ran_s > 0:
                durations.append(how.ran_s)
                tasks.append(group)
                timed_out.append(how.timed_out)
    return fit_duration_model(durations, tasks, timed_out)
