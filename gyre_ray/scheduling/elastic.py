"""`elastic`: water-level control of cell roles.

Every decision does, in this order:
1. **Return.** If the demand the rollout side must carry (in-flight executions, calls queued
   beyond the rollout cells' capacity, `queued_demand`, and pending executions the staleness bound
   lets launch) exceeds the rollout capacity (ready cells and cells already coming back), trainers
   go back to rollout until it does not, at any decision, not only at a step's end: satellites
   before the core, idle trainers before busy ones; a busy one finishes its micro-step first.
2. **Launch.** Pending launchable executions go, oldest batch first, to the rollout cell with the
   most room.
3. **Water level.** While no cell is coming back, a rollout cell switches to training if the
   rollout cells that remain can hold the demand (its own executions migrate to them) and enough
   trainable work is queued to repay the switch: the training backlog per trainer, this cell
   included, must be at least `repay_factor` x (switch in + switch out) (any backlog will do when
   no cell trains yet). The core goes first, then
   satellites with the fewest executions to migrate. Satellites that switch join the training
   step in progress (they claim the current batch's micro-steps).

"Demand" depends on how executions of *later* batches (prefetch, possible when eta >= 1) are
treated, the `prefetch` knob:
- `eager` (default): demand is every in-flight and every launchable execution, so a newly
  launchable batch pulls trainers back at once. Best when rollouts are the long pole.
- `spare`: demand is in-flight executions plus pending ones of the current batch; prefetch
  executions only fill room left on cells that stay in rollout anyway, and only idle trainers
  (no trainable work queued) come back for them. Best when training is the long pole.
- `paced`: like eager, except that enough cells keep training the trainable batch to clear its
  queued work by `pace_s` after its latest launch: ceil(backlog / (latest launch + pace_s - now))
  cells, at least one while work is queued (all of them once that moment has passed). Launching
  the next batch at once and training the current one at the pace its stragglers allow, instead
  of stopping it (eager) or putting it first (spare).
- `trickle`: spare, except that later batches only fill room inside the cells the trainable
  batch's own executions need (ceil of their demand over a cell's capacity), so a batch's
  stragglers keep one cell busy with the next batch's launches instead of holding it near empty,
  and cells the current batch no longer needs can go to training. While the trainable batch has
  nothing in flight, later batches fill every rollout cell as in spare. An idle trainer comes back
  for later batches only where trickle would give it some (in the simulator, whose cells are equal
  and never overfilled, only while the trainable batch has nothing in flight): a return it would
  not fill is a switch for nothing.
With eta = 0 there is no prefetch and the modes decide the same.

`launch_order` says which pending executions of a batch go first: `fifo` (default, id order) or
`sibling` (`gyre_ray.scheduling.launch_order`: a probe of every untouched task, then tasks whose
launched executions look longest; needs `duration_prior`, the workload's duration model).
"""

from __future__ import annotations

import dataclasses
import math

from gyre_ray.scheduling.base import (
    EPS,
    Policy,
    free_rollout_capacity,
    place_pending,
    register_policy,
)
from gyre_ray.scheduling.launch_order import DurationPrior, SiblingOrder
from gyre_ray.scheduling.state import (
    Action,
    CellState,
    Launch,
    ReadOnlySequence,
    Role,
    SchedState,
    SwitchToRollout,
    SwitchToTrain,
)

PREFETCH_MODES = ("eager", "spare", "paced", "trickle")
LAUNCH_ORDERS = ("fifo", "sibling")


@register_policy
class ElasticPolicy(Policy):
    """Water-level control: cells move to training as rollout demand drains and come back with it."""

    name = "elastic"

    def __init__(
        self,
        repay_factor: float = 1.0,
        prefetch: str = "eager",
        pace_s: float = 5400.0,
        launch_order: str = "fifo",
        duration_prior: DurationPrior | None = None,
    ) -> None:
        if repay_factor < 0:
            raise ValueError(f"elastic policy: repay_factor must be >= 0, got {repay_factor}")
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"elastic policy: prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
        if pace_s <= 0:
            raise ValueError(f"elastic policy: pace_s must be > 0, got {pace_s}")
        if launch_order not in LAUNCH_ORDERS:
            raise ValueError(
                f"elastic policy: launch_order must be one of {LAUNCH_ORDERS}, got {launch_order!r}"
            )
        if launch_order == "sibling" and duration_prior is None:
            raise ValueError(
                "elastic policy: launch_order 'sibling' needs duration_prior (the duration model)"
            )
        self.repay_factor = repay_factor
        self.prefetch = prefetch
        self.pace_s = pace_s
        self.launch_order = launch_order
        self._sibling = SiblingOrder(duration_prior) if launch_order == "sibling" and duration_prior else None

    def decide(self, state: SchedState) -> list[Action]:
        if state.policy_version >= state.steps_total:
            return []
        free = free_rollout_capacity(state)
        room = sum(free.values())
        if self._sibling is not None and room > EPS and state.launchable_demand() > EPS:
            state = dataclasses.replace(state, pending=ReadOnlySequence(self._sibling.order(state, room)))
        capacity = sum(c.rollout_capacity for c in state.cells_in(Role.ROLLOUT))
        in_flight = sum(c.load for c in state.cells) + state.queued_demand
        urgent = in_flight + state.launchable_demand(max_lag=0)
        everything = in_flight + state.launchable_demand()
        actions: list[Action] = []
        holds_back = self.prefetch in ("spare", "trickle")  # later batches wait for room left over
        if self.prefetch == "eager":
            demand = everything
        elif holds_back:
            demand = urgent
        else:
            demand = min(everything, max(urgent, self._rollout_room_at_pace(state)))
        deficit = demand - capacity
        if deficit > EPS:
            actions.extend(self._return_cells(state, deficit))
        elif state.ready_work_s <= EPS:
            # trainers with nothing to train come back for prefetch executions, as far as the mode
            # would place them beyond the room the rollout cells already have
            wanted = min(everything - capacity, self._later_allowance(state, {}) - room)
            if wanted > EPS:
                actions.extend(self._return_cells(state, wanted, idle_only=True))
        returning = bool(actions)
        placed: dict[int, list[float]] = {}
        actions.extend(place_pending(state, free, max_lag=0 if holds_back else None, placed=placed))
        if deficit <= EPS and not returning:
            actions.extend(self._water_level(state, free, capacity, demand, placed))
        if holds_back:
            launched = {a.exec_id for a in actions if isinstance(a, Launch)}
            later = _room_within(free, self._later_allowance(state, placed))
            actions.extend(place_pending(state, later, skip=launched))
        return actions

    def _later_allowance(self, state: SchedState, placed: dict[int, list[float]]) -> float:
        """How much demand of later batches may launch now: no limit but room, except under trickle
        (`_trickle_allowance`)."""
        return _trickle_allowance(state, placed) if self.prefetch == "trickle" else math.inf

    def _rollout_room_at_pace(self, state: SchedState) -> float:
        """`paced`: rollout capacity left once enough cells train to clear the backlog at the pace."""
        v = state.policy_version
        launches = [e.launched_at for e in state.in_flight.values() if e.batch == v]
        if state.pending_demand.get(v, 0.0) > EPS:
            launches.append(state.now)  # the batch's own pending executions launch now
        left_s = max(launches, default=-math.inf) + self.pace_s - state.now
        backlog = state.ready_work_s + sum(
            max(0.0, c.micro_step_until - state.now) for c in state.cells if c.micro_step_until is not None
        )
        total = sum(c.rollout_capacity for c in state.cells)
        if backlog <= EPS:
            return total
        if left_s <= EPS:
            return 0.0
        trainers = min(len(state.cells), math.ceil(backlog / left_s - EPS))
        return total * (1.0 - trainers / len(state.cells))

    @staticmethod
    def _return_cells(state: SchedState, deficit: float, idle_only: bool = False) -> list[Action]:
        """Trainers to send back so that rollout capacity covers `deficit` more demand."""
        trainers = state.cells_in(Role.TRAIN)
        deficit -= sum(c.rollout_capacity for c in trainers if c.return_requested)
        if idle_only:
            trainers = [c for c in trainers if c.ready and c.micro_step_until is None]

        def order(c: CellState) -> tuple:
            if not c.ready:
                rank, until = 2, c.switching_until  # still switching in: returning wastes the switch
            elif c.micro_step_until is None:
                rank, until = 0, 0.0  # idle: comes back at once
            else:
                rank, until = 1, c.micro_step_until
            return (c.is_core, rank, until, -c.cell_id)

        actions: list[Action] = []
        for cell in sorted((c for c in trainers if not c.return_requested), key=order):
            if deficit <= EPS:
                break
            actions.append(SwitchToRollout(cell.cell_id))
            deficit -= cell.rollout_capacity
        return actions

    def _water_level(
        self,
        state: SchedState,
        free: dict[int, float],
        capacity: float,
        demand: float,
        placed: dict[int, list[float]],
    ) -> list[Action]:
        """Rollout cells to switch to training now (possibly none)."""
        if any(c.role is Role.TRAIN and c.return_requested for c in state.cells):
            return []
        if any(c.role is Role.ROLLOUT and not c.ready for c in state.cells):
            return []  # cells are coming back: demand just rose
        trainers = state.cells_in(Role.TRAIN)
        backlog = state.ready_work_s + sum(
            max(0.0, c.micro_step_until - state.now) for c in trainers if c.micro_step_until is not None
        )
        repay_s = self.repay_factor * (state.switch_to_train_s + state.switch_to_rollout_s)
        candidates = sorted(
            (c for c in state.cells if c.role is Role.ROLLOUT and c.ready),
            key=lambda c: (not c.is_core, c.load, c.cell_id),
        )
        n_trainers = len(trainers)
        # demands this decision puts onto cells that the state does not show yet (launches, migrations)
        moved_in = {cell_id: list(items) for cell_id, items in placed.items()}
        actions: list[Action] = []
        for cell in candidates:
            if backlog <= EPS:
                break
            if n_trainers and backlog / (n_trainers + 1) + EPS < repay_s:
                break  # the work would not repay the switch (with no trainer at all, someone must train)
            if capacity - cell.rollout_capacity + EPS < demand:
                break  # the cells left could not hold every in-flight and launchable execution
            if not _migrate_into(state, cell, free, moved_in):
                continue
            actions.append(SwitchToTrain(cell.cell_id))
            capacity -= cell.rollout_capacity
            n_trainers += 1
        return actions


def _migrate_into(
    state: SchedState, leaving: CellState, free: dict[int, float], moved_in: dict[int, list[float]]
) -> bool:
    """Plan moving `leaving`'s executions (its own and those planned onto it) into the other cells.

    Uses the simulator's rule (largest demand first, into the cell with the most room). On success
    updates `free` and `moved_in`.
    """
    rooms = {cell_id: room for cell_id, room in free.items() if cell_id != leaving.cell_id}
    hosted = state.in_flight_by_cell.get(leaving.cell_id, {})
    demands = [e.demand for e in hosted.values()] + moved_in.get(leaving.cell_id, [])
    plan: dict[int, list[float]] = {}
    for demand in sorted(demands, reverse=True):
        if not rooms:
            return False
        best = max(rooms, key=rooms.__getitem__)
        if rooms[best] + EPS < demand:
            return False
        rooms[best] -= demand
        plan.setdefault(best, []).append(demand)
    free.clear()
    free.update(rooms)
    moved_in.pop(leaving.cell_id, None)
    for cell_id, items in plan.items():
        moved_in.setdefault(cell_id, []).extend(items)
    return True


def _trickle_allowance(state: SchedState, placed: dict[int, list[float]]) -> float:
    """`trickle`: how much demand of later batches may launch now (inf while the trainable batch
    has nothing in flight): the room left inside the cells the trainable batch's executions (those
    `placed` by this decision included) need, ceil of their demand over a cell's capacity."""
    v = state.policy_version
    placed_demand = sum(sum(items) for items in placed.values())
    # executions booked on a cell out of the rollout role (or lost for good) are in `queued_demand`
    # already (the runtime's; the simulator moves them when the cell leaves, and queues nothing)
    rollout = {c.cell_id for c in state.cells if c.role is Role.ROLLOUT}
    elsewhere = sum(
        e.demand
        for cell_id, executions in state.in_flight_by_cell.items()
        if cell_id not in rollout
        for e in executions.values()
        if e.batch <= v
    )
    current = state.in_flight_demand(v) - elsewhere + placed_demand + state.queued_demand
    if current <= EPS:
        return math.inf
    per_cell = max(c.rollout_capacity for c in state.cells)
    load = sum(c.load for c in state.cells) + placed_demand
    return math.ceil(current / per_cell - EPS) * per_cell - load


def _room_within(free: dict[int, float], allowed: float) -> dict[int, float]:
    """`free` room cut to `allowed` demand in all, fullest cells first (they stay in rollout anyway)."""
    if allowed == math.inf:
        return free
    room: dict[int, float] = {}
    for cell_id in sorted(free, key=lambda c: (free[c], c)):
        take = min(free[cell_id], max(0.0, allowed))
        room[cell_id] = take
        allowed -= take
    return room
