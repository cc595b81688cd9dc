"""Discrete-event simulation of a whole training run, driven by a scheduling policy.

The simulator owns the clock (an event heap: execution ends, switch ends, micro-step ends,
optimizer-step ends; no ticking), applies the policy's actions after every batch of
simultaneous events, and does the mechanical parts a real backend does:
- an execution holds `demand` units of its cell's rollout capacity from launch to end; when its
  cell switches to training it migrates to another rollout cell and pauses `migration_pause_s`;
- a group's training work is queued when its last execution ends;
- idle trainers claim micro-steps of the current batch's queued work (at most `micro_step_s`
  each; when little is queued, the idle trainers split it evenly);
- when a batch's executions have all ended and its work is trained, the update takes
  `grad_sync_s` per extra cell that trained it plus `optimizer_step_s`, then the version moves on;
  rollout cells pause `weight_sync_s` to load it (trainers hold it already). A batch with no
  training work at all (a replayed step whose every execution had advantage 0) takes neither: the
  runtime skips its optimizer step and publishes no weights.
Actions that break a rule (launch past the staleness bound or into a full or non-rollout cell,
switch a cell whose executions cannot migrate) raise `SimulationError`: the policy is wrong.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from types import MappingProxyType

from gyre_ray.scheduling.base import Policy
from gyre_ray.scheduling.state import (
    CellState,
    EndedExecution,
    Execution,
    Launch,
    PendingExecution,
    ReadOnlySequence,
    Role,
    SchedState,
    SwitchToRollout,
    SwitchToTrain,
)
from gyre_ray.sim.timeline import SimResult, Timeline
from gyre_ray.sim.workload import SampledWorkload

EPS = 1e-6
_EXEC_END, _SWITCH_DONE, _MICRO_DONE, _UPDATE_DONE = 0, 1, 2, 3


class SimulationError(RuntimeError):
    """A policy asked for something impossible, or the run stalled."""


@dataclass(frozen=True)
class SimCosts:
    """Time costs of the mechanics (seconds); defaults documented in docs/scheduling.md."""

    switch_to_train_s: float = 8.52
    switch_to_rollout_s: float = 3.46
    weight_sync_s: float = 5.0
    migration_pause_s: float = 8.52
    optimizer_step_s: float = 10.0
    grad_sync_s: float = 2.0
    micro_step_s: float = 60.0


@dataclass
class _Cell:
    cell_id: int
    role: Role
    capacity: float
    load: float = 0.0
    execs: dict[int, Execution] = field(default_factory=dict)
    switching_until: float | None = None
    micro_until: float | None = None
    micro_batch: int = -1
    return_requested: bool = False
    paused_until: float = 0.0

    def view(self) -> CellState:
        return CellState(
            self.cell_id,
            self.role,
            self.capacity,
            self.load,
            len(self.execs),
            self.switching_until,
            self.micro_until,
            self.return_requested,
        )

    def kind(self) -> str:
        if self.role is Role.ROLLOUT:
            return "rollout" if self.switching_until is None else "to_rollout"
        return "train" if self.switching_until is None else "to_train"


class Simulator:
    """One policy on one sampled workload on `n_cells` cells."""

    def __init__(
        self,
        workload: SampledWorkload,
        policy: Policy,
        n_cells: int,
        staleness: int,
        costs: SimCosts | None = None,
        record: bool = True,
    ) -> None:
        if n_cells < 1:
            raise ValueError(f"n_cells must be >= 1, got {n_cells}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.wl, self.policy, self.n_cells, self.staleness = workload, policy, n_cells, staleness
        self.costs = costs or SimCosts()
        self.steps = workload.steps
        self.dur = workload.duration_s.tolist()
        self.batch_of = workload.batch.tolist()
        self.group_of = workload.group.tolist()
        self.demand = workload.demand.tolist()
        work = workload.train_cell_s(n_cells)
        self.group_work = [0.0] * workload.n_groups
        self.group_left = [0] * workload.n_groups
        for g, w in zip(self.group_of, work.tolist(), strict=True):
            self.group_work[g] += w
            self.group_left[g] += 1
        # a batch without training work (a replayed step of advantage 0 only) takes no optimizer step,
        # gradient or weight sync, as in the runtime and in the bound (`bound.step_costs`)
        self.has_work = (workload.train_cell_s_per_batch(n_cells) > 0).tolist()
        capacity = workload.capacity_per_cell(n_cells)
        biggest = float(workload.demand.max()) if workload.n_executions else 0.0
        if biggest > capacity + EPS:
            spec = workload.spec
            sigma = f" (demand_sigma {spec.demand_sigma:g})" if spec.demand_sigma > 0 else ""
            raise ValueError(
                f"{n_cells} cells get {capacity:.3g} executions of rollout capacity each, under one "
                f"execution's demand of {biggest:.3g}{sigma}: the workload's capacity is {spec.capacity_origin()}; "
                f"set capacity_executions >= {math.ceil(biggest * n_cells - EPS):,} or use fewer cells"
                + (" or a smaller demand_sigma" if sigma else "")
            )
        roles = policy.initial_roles(n_cells)
        if len(roles) != n_cells:
            raise SimulationError(f"{policy.name}: initial_roles gave {len(roles)} roles for {n_cells} cells")
        self.cells = [_Cell(i, role, capacity) for i, role in enumerate(roles)]
        self.pending: dict[int, PendingExecution] = {
            e: PendingExecution(e, self.batch_of[e], self.demand[e], self.group_of[e])
            for e in range(len(self.dur))
        }
        self.pending_demand: dict[int, float] = {}
        self.unended = [0] * self.steps
        for e, b in enumerate(self.batch_of):
            self.pending_demand[b] = self.pending_demand.get(b, 0.0) + self.demand[e]
            self.unended[b] += 1
        self.pending_count = list(self.unended)
        self.ready = [0.0] * self.steps
        self.in_progress = [0] * self.steps
        self.trained_by = [set() for _ in range(self.steps)]
        self.in_flight: dict[int, Execution] = {}
        self.in_flight_demand: dict[int, float] = {}  # by batch, kept exact as pending_demand is
        self.end_time = [0.0] * len(self.dur)
        self.version = 0
        self.updating = False
        self.now = 0.0
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.switches = 0
        self.tl = Timeline(n_cells, len(self.dur), self.steps, record)
        for c in self.cells:
            self.tl.segment(c.cell_id, 0.0, c.kind())
        self._by_cell = MappingProxyType({c.cell_id: MappingProxyType(c.execs) for c in self.cells})
        # what each task's launched executions showed so far (read-only views for the policy)
        self.timed_out = workload.timed_out.tolist()
        self._group_ended: dict[int, list[EndedExecution]] = {}
        self._group_running: dict[int, dict[int, float]] = {}
        self._ended_views: dict[int, ReadOnlySequence] = {}
        self._running_views: dict[int, MappingProxyType] = {}
        self._pending_by_group: dict[int, dict[int, PendingExecution]] = {}
        for e, item in self.pending.items():
            self._pending_by_group.setdefault(item.group, {})[e] = item
        self._pending_group_views = {
            g: MappingProxyType(items) for g, items in self._pending_by_group.items()
        }
        self._views = (
            MappingProxyType(self.in_flight),
            ReadOnlySequence(self.pending),
            MappingProxyType(self.pending_demand),
            MappingProxyType(self.in_flight_demand),
        )

    # ----------------------------------------------------------------- loop
    def run(self, give_up_after_s: float = math.inf) -> SimResult | None:
        """Run until every batch is trained; returns makespan, metrics and (if recorded) the timeline.

        Returns None once the clock passes `give_up_after_s` (used to cut sweeps short).
        """
        self._decide()
        while self.version < self.steps:
            if not self.heap:
                raise SimulationError(self._stall_message())
            t = self.heap[0][0]
            if t > give_up_after_s:
                return None
            self.now = t
            while self.heap and self.heap[0][0] == t:
                _, _, kind, arg = heapq.heappop(self.heap)
                self._handle(kind, arg)
            self._decide()
        for c in self.cells:
            self.tl.close(c.cell_id, self.now)
        return self.tl.result(self, self.now)

    def _push(self, t: float, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, arg))

    def _handle(self, kind: int, arg: int) -> None:
        if kind == _EXEC_END:
            if arg in self.in_flight and self.end_time[arg] == self.now:
                self._end_execution(arg)
        elif kind == _SWITCH_DONE:
            cell = self.cells[arg]
            cell.switching_until = None
            self.tl.segment(arg, self.now, cell.kind())
            if cell.role is Role.TRAIN and cell.return_requested:
                self._start_switch(cell, Role.ROLLOUT)
        elif kind == _MICRO_DONE:
            cell = self.cells[arg]
            self.in_progress[cell.micro_batch] -= 1
            cell.micro_until, cell.micro_batch = None, -1
            if cell.return_requested:
                self._start_switch(cell, Role.ROLLOUT)
            self._maybe_update()
        elif kind == _UPDATE_DONE:
            self._finish_update()

    def _decide(self) -> None:
        if self.version >= self.steps:
            return
        for action in self.policy.decide(self._state()):
            if isinstance(action, Launch):
                self._launch(action.exec_id, action.cell_id)
            elif isinstance(action, SwitchToTrain):
                self._switch_to_train(action.cell_id)
            elif isinstance(action, SwitchToRollout):
                self._switch_to_rollout(action.cell_id)
            else:
                raise SimulationError(f"{self.policy.name}: unknown action {action!r}")
        self._claim_micro_steps()
        self._maybe_update()

    def _state(self) -> SchedState:
        v = self.version
        in_flight, pending, pending_demand, in_flight_demand = self._views
        return SchedState(
            now=self.now,
            policy_version=v,
            steps_total=self.steps,
            staleness=self.staleness,
            cells=tuple(c.view() for c in self.cells),
            in_flight=in_flight,
            in_flight_by_cell=self._by_cell,
            pending=pending,
            pending_demand=pending_demand,
            ready_work_s=self.ready[v] if v < self.steps else 0.0,
            unended_in_trainable=self.unended[v] if v < self.steps else 0,
            updating=self.updating,
            switch_to_train_s=self.costs.switch_to_train_s,
            switch_to_rollout_s=self.costs.switch_to_rollout_s,
            group_ended=MappingProxyType(self._ended_views),
            group_running=MappingProxyType(self._running_views),
            pending_by_group=MappingProxyType(self._pending_group_views),
            in_flight_demand_by_batch=in_flight_demand,
        )

    # -------------------------------------------------------------- actions
    def _launch(self, e: int, cell_id: int) -> None:
        item = self.pending.get(e)
        if item is None:
            raise SimulationError(f"{self.policy.name}: launch of execution {e}, which is not pending")
        if item.batch - self.version > self.staleness:
            raise SimulationError(
                f"{self.policy.name}: launch of execution {e} (batch {item.batch}) at version {self.version} "
                f"exceeds the staleness bound eta={self.staleness}"
            )
        cell = self._cell(cell_id)
        if cell.role is not Role.ROLLOUT or cell.switching_until is not None:
            raise SimulationError(
                f"{self.policy.name}: launch on cell {cell_id}, which is not a ready rollout cell"
            )
        if cell.load + item.demand > cell.capacity + EPS:
            raise SimulationError(
                f"{self.policy.name}: launch on cell {cell_id} exceeds its capacity "
                f"({cell.load:g} + {item.demand:g} > {cell.capacity:g})"
            )
        del self.pending[e]
        siblings = self._pending_by_group[item.group]
        del siblings[e]
        if not siblings:
            del self._pending_by_group[item.group], self._pending_group_views[item.group]
        self.pending_count[item.batch] -= 1
        if self.pending_count[item.batch]:
            self.pending_demand[item.batch] -= item.demand
        else:
            del self.pending_demand[item.batch]  # exactly zero, no float dust
        start = max(self.now, cell.paused_until)
        ex = Execution(e, item.batch, item.demand, cell_id, self.now, self.version, item.group)
        self.in_flight[e] = ex
        self.in_flight_demand[item.batch] = self.in_flight_demand.get(item.batch, 0.0) + item.demand
        running = self._group_running.get(item.group)
        if running is None:
            running = self._group_running[item.group] = {}
            self._group_ended[item.group] = []
            self._running_views[item.group] = MappingProxyType(running)
            self._ended_views[item.group] = ReadOnlySequence(self._group_ended[item.group])
        running[e] = self.now
        self._host(cell, ex)
        self.tl.launch(e, self.now, self.version)
        if start > self.now:
            self.tl.delay(e, start - self.now)  # the cell is loading new weights
        self._set_end(e, start + self.dur[e])

    def _switch_to_train(self, cell_id: int) -> None:
        cell = self._cell(cell_id)
        if cell.role is not Role.ROLLOUT or cell.switching_until is not None:
            raise SimulationError(
                f"{self.policy.name}: switch to train of cell {cell_id}, not a ready rollout cell"
            )
        self._migrate_all(cell)
        self._start_switch(cell, Role.TRAIN)

    def _switch_to_rollout(self, cell_id: int) -> None:
        cell = self._cell(cell_id)
        if cell.role is not Role.TRAIN:
            raise SimulationError(f"{self.policy.name}: switch to rollout of cell {cell_id}, not a trainer")
        if cell.switching_until is not None or cell.micro_until is not None:
            cell.return_requested = True  # after the switch-in or micro-step in progress
        else:
            self._start_switch(cell, Role.ROLLOUT)

    # ------------------------------------------------------------ mechanics
    def _cell(self, cell_id: int) -> _Cell:
        if not 0 <= cell_id < self.n_cells:
            raise SimulationError(f"{self.policy.name}: no cell {cell_id} (cells 0..{self.n_cells - 1})")
        return self.cells[cell_id]

    def _start_switch(self, cell: _Cell, role: Role) -> None:
        cost = self.costs.switch_to_train_s if role is Role.TRAIN else self.costs.switch_to_rollout_s
        cell.role, cell.return_requested = role, False
        cell.switching_until = self.now + cost
        self.switches += 1
        self.tl.segment(cell.cell_id, self.now, cell.kind())
        self._push(cell.switching_until, _SWITCH_DONE, cell.cell_id)

    def _host(self, cell: _Cell, ex: Execution) -> None:
        cell.execs[ex.exec_id] = ex
        cell.load += ex.demand
        self.tl.host_start(ex.exec_id, cell.cell_id, self.now)
        self.tl.load(cell.cell_id, self.now, cell.load)

    def _unhost(self, cell: _Cell, e: int) -> Execution:
        ex = cell.execs.pop(e)
        cell.load -= ex.demand
        if not cell.execs:
            cell.load = 0.0  # no float dust
        self.tl.host_end(e, cell.cell_id, self.now)
        self.tl.load(cell.cell_id, self.now, cell.load)
        return ex

    def _set_end(self, e: int, t: float) -> None:
        self.end_time[e] = t
        self._push(t, _EXEC_END, e)

    def _migrate_all(self, leaving: _Cell) -> None:
        targets = [
            c for c in self.cells if c is not leaving and c.role is Role.ROLLOUT and c.switching_until is None
        ]
        moving = sorted(leaving.execs.values(), key=lambda x: -x.demand)
        for ex in moving:
            best = max(targets, key=lambda c: c.capacity - c.load, default=None)
            if best is None or best.capacity - best.load + EPS < ex.demand:
                raise SimulationError(
                    f"{self.policy.name}: cell {leaving.cell_id} switched to training but its "
                    f"{len(leaving.execs)} executions do not fit on the other rollout cells"
                )
            self._unhost(leaving, ex.exec_id)
            moved = Execution(
                ex.exec_id, ex.batch, ex.demand, best.cell_id, ex.launched_at, ex.launch_version, ex.group
            )
            self.in_flight[ex.exec_id] = moved
            self._host(best, moved)
            pause = max(self.costs.migration_pause_s, best.paused_until - self.now)
            if pause > 0:
                self.tl.delay(ex.exec_id, pause)
                self._set_end(ex.exec_id, self.end_time[ex.exec_id] + pause)

    def _end_execution(self, e: int) -> None:
        ex = self.in_flight.pop(e)
        if self.unended[ex.batch] - self.pending_count[ex.batch] > 1:  # others of its batch still run
            self.in_flight_demand[ex.batch] -= ex.demand
        else:
            del self.in_flight_demand[ex.batch]  # exactly zero, no float dust
        self._unhost(self.cells[ex.cell_id], e)
        self.tl.end(e, self.now)
        self.unended[ex.batch] -= 1
        g = self.group_of[e]
        del self._group_running[g][e]
        self._group_ended[g].append(EndedExecution(self.now - ex.launched_at, self.timed_out[e]))
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.ready[ex.batch] += self.group_work[g]
            self.tl.release(ex.batch, self.now, self.group_work[g])
        self._maybe_update()

    def _claim_micro_steps(self) -> None:
        v = self.version
        if self.updating or v >= self.steps or self.ready[v] <= EPS:
            return
        idle = [
            c
            for c in self.cells
            if c.role is Role.TRAIN
            and c.switching_until is None
            and c.micro_until is None
            and not c.return_requested
        ]
        if not idle:
            return
        share = min(self.costs.micro_step_s, self.ready[v] / len(idle))
        for cell in idle:
            amount = min(share, self.ready[v])
            if self.ready[v] - amount <= EPS:
                amount = self.ready[v]
            if amount <= EPS:
                break
            self.ready[v] -= amount
            self.in_progress[v] += 1
            self.trained_by[v].add(cell.cell_id)
            cell.micro_until, cell.micro_batch = self.now + amount, v
            self.tl.micro(cell.cell_id, self.now, self.now + amount, v, amount)
            self._push(cell.micro_until, _MICRO_DONE, cell.cell_id)
        if self.ready[v] <= EPS:
            self.ready[v] = 0.0

    def _maybe_update(self) -> None:
        v = self.version
        if self.updating or v >= self.steps:
            return
        if self.unended[v] or self.in_progress[v] or self.ready[v] > EPS:
            return
        self.updating = True
        if not self.has_work[v]:
            self._push(self.now, _UPDATE_DONE, v)
            return
        extra_cells = max(0, len(self.trained_by[v]) - 1)
        self._push(
            self.now + extra_cells * self.costs.grad_sync_s + self.costs.optimizer_step_s, _UPDATE_DONE, v
        )

    def _finish_update(self) -> None:
        published = self.has_work[self.version]
        self.updating = False
        self.version += 1
        self.tl.update(self.now)
        sync = self.costs.weight_sync_s
        if sync <= 0 or self.version >= self.steps or not published:
            return
        for cell in self.cells:
            if cell.role is not Role.ROLLOUT:
                continue
            if cell.switching_until is not None:
                cell.paused_until = cell.switching_until + sync
                continue
            cell.paused_until = self.now + sync
            for e in cell.execs:
                self.tl.delay(e, sync)
                self._set_end(e, self.end_time[e] + sync)

    def _stall_message(self) -> str:
        roles = ", ".join(f"{c.cell_id}:{c.kind()}" for c in self.cells)
        return (
            f"{self.policy.name}: run stalled at t={self.now:.1f}s, version {self.version}/{self.steps}: "
            f"no events left (cells {roles}; {len(self.pending)} pending, {len(self.in_flight)} in flight, "
            f"{self.ready[self.version]:.1f} cell-s of trainable work queued)"
        )
