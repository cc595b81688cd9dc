"""Scheduling policies on hand-built states: each rule of colocate, async and elastic, one test each."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from gyre_ray.scheduling.base import make_policy, policy_names
from gyre_ray.scheduling.state import (
    CellState,
    Execution,
    Launch,
    PendingExecution,
    Role,
    SchedState,
    SwitchToRollout,
    SwitchToTrain,
)

R, T = Role.ROLLOUT, Role.TRAIN


def cell(i: int, role: Role = R, cap: float = 4, **kw) -> CellState:
    return CellState(cell_id=i, role=role, rollout_capacity=cap, **kw)


def state(
    cells: list[CellState],
    hosted: dict[int, int] | None = None,
    pending: list[tuple[int, int]] | None = None,
    version: int = 0,
    eta: int = 0,
    ready: float = 0.0,
    unended: int | None = None,
    steps: int = 10,
    now: float = 100.0,
) -> SchedState:
    """A state; `hosted` maps cell id -> number of in-flight executions (demand 1, batch `version`),
    `pending` lists (batch, count) of not-yet-launched executions (demand 1)."""
    hosted = hosted or {}
    in_flight, by_cell, next_id = {}, {c.cell_id: {} for c in cells}, 0
    for cell_id, n in hosted.items():
        for _ in range(n):
            ex = Execution(next_id, version, 1.0, cell_id, 0.0, version)
            in_flight[next_id] = by_cell[cell_id][next_id] = ex
            next_id += 1
    cells = [
        replace(c, load=float(hosted.get(c.cell_id, 0)), n_executions=hosted.get(c.cell_id, 0)) for c in cells
    ]
    items, demand = [], {}
    for batch, count in pending or []:
        for _ in range(count):
            items.append(PendingExecution(next_id, batch, 1.0))
            next_id += 1
        demand[batch] = demand.get(batch, 0.0) + count
    if unended is None:
        unended = len(in_flight) + int(demand.get(version, 0))
    return SchedState(
        now=now,
        policy_version=version,
        steps_total=steps,
        staleness=eta,
        cells=tuple(cells),
        in_flight=in_flight,
        in_flight_by_cell=by_cell,
        pending=items,
        pending_demand=demand,
        ready_work_s=ready,
        unended_in_trainable=unended,
    )


def of(kind, actions) -> list[int]:
    return [a.cell_id for a in actions if isinstance(a, kind)]


# ------------------------------------------------------------------ elastic


def test_elastic_no_switch_when_remaining_cells_cannot_hold_in_flight() -> None:
    s = state([cell(0), cell(1)], hosted={0: 3, 1: 2}, ready=1e4)  # 5 executions, one cell holds 4
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == []


def test_elastic_switches_once_remaining_cells_can_hold_in_flight() -> None:
    s = state([cell(0), cell(1)], hosted={0: 2, 1: 2}, ready=1e4)
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == [0]


def test_elastic_core_switches_first_even_when_busier() -> None:
    cells = [cell(i) for i in range(4)]
    s = state(cells, hosted={0: 3, 1: 1, 2: 1, 3: 0}, ready=20.0)  # 20 s of work repays one switch only
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == [0]


def test_elastic_then_least_loaded_satellites_while_work_repays() -> None:
    cells = [cell(0, T), cell(1), cell(2), cell(3)]
    s = state(cells, hosted={1: 1, 2: 3, 3: 0}, ready=1e4)
    # three satellites, four executions: two can leave (the emptiest first), one must stay
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == [3, 1]


def test_elastic_waits_when_queued_work_would_not_repay_the_switch() -> None:
    cells = [cell(0, T, micro_step_until=101.0), cell(1), cell(2)]
    s = state(cells, hosted={1: 1}, ready=5.0)  # 6 s of backlog for two trainers < 11.98 s of switching
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == []
    assert of(SwitchToTrain, make_policy("elastic", repay_factor=0.0).decide(s)) == [2]


def test_elastic_first_trainer_goes_whatever_the_backlog() -> None:
    s = state([cell(0), cell(1)], hosted={1: 1}, ready=1.0)
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == [0]


def test_elastic_satellites_join_the_step_in_progress() -> None:
    cells = [cell(0, T, micro_step_until=160.0), cell(1), cell(2), cell(3)]
    s = state(cells, hosted={1: 2, 2: 0, 3: 1}, pending=[], ready=600.0, version=3, unended=3)
    joined = of(SwitchToTrain, make_policy("elastic").decide(s))
    assert joined and 0 not in joined and set(joined) <= {1, 2, 3}
    assert len(joined) == 2  # three executions need one rollout cell


def test_elastic_returns_cells_when_demand_exceeds_capacity() -> None:
    cells = [cell(0, T, micro_step_until=150.0), cell(1, T, micro_step_until=120.0), cell(2, T), cell(3)]
    s = state(cells, hosted={3: 4}, pending=[(1, 4)], version=1, ready=0.0)
    actions = make_policy("elastic").decide(s)
    # four more executions need one more cell: the idle satellite comes back, the core keeps training
    assert of(SwitchToRollout, actions) == [2]
    s = state(cells, hosted={3: 4}, pending=[(1, 12)], version=1)
    assert of(SwitchToRollout, make_policy("elastic").decide(s)) == [2, 1, 0]  # core last


def test_elastic_counts_returns_already_requested() -> None:
    cells = [cell(0, T), cell(1, T, micro_step_until=150.0, return_requested=True), cell(2)]
    s = state(cells, hosted={2: 4}, pending=[(0, 4)])
    assert of(SwitchToRollout, make_policy("elastic").decide(s)) == []


def test_elastic_never_switches_out_while_cells_are_coming_back() -> None:
    cells = [cell(0, R, switching_until=103.0), cell(1), cell(2)]
    s = state(cells, hosted={1: 1}, ready=1e4)
    assert of(SwitchToTrain, make_policy("elastic").decide(s)) == []


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
@pytest.mark.parametrize("eta", [0, 1, 2])
def test_launches_never_exceed_the_staleness_bound(policy: str, eta: int) -> None:
    cells = [cell(0, T)] + [cell(i, cap=100) for i in range(1, 4)]
    s = state(cells, pending=[(2, 3), (3, 3), (4, 3), (5, 3)], version=2, eta=eta)
    launched = {a.exec_id for a in make_policy(policy).decide(s) if isinstance(a, Launch)}
    batches = {p.batch for p in s.pending if p.exec_id in launched}
    allowed = 0 if policy == "colocate" else eta
    assert batches == set(range(2, 3 + allowed))


def test_launches_respect_capacity_and_go_to_the_emptiest_cell() -> None:
    s = state([cell(0, cap=4), cell(1, cap=4)], hosted={0: 3}, pending=[(0, 6)])
    launches = [a for a in make_policy("elastic").decide(s) if isinstance(a, Launch)]
    per_cell = {c: sum(a.cell_id == c for a in launches) for c in (0, 1)}
    assert per_cell == {0: 1, 1: 4}


def test_spare_prefetch_keeps_busy_trainers_training() -> None:
    cells = [cell(0, T, micro_step_until=150.0), cell(1), cell(2)]
    s = state(cells, hosted={1: 2}, pending=[(1, 20)], version=0, eta=1, ready=300.0, unended=2)
    eager = make_policy("elastic", prefetch="eager").decide(s)
    spare = make_policy("elastic", prefetch="spare").decide(s)
    assert of(SwitchToRollout, eager) == [0]  # eager: the later batch pulls the trainer back
    # spare: the trainer keeps training, the empty satellite joins it, prefetch fills the room left
    assert of(SwitchToRollout, spare) == [] and of(SwitchToTrain, spare) == [2]
    assert of(Launch, spare) == [1, 1]


def test_paced_prefetch_keeps_the_trainers_the_backlog_needs() -> None:
    # batch 0: one execution in flight (launched at 0) on cell 4; 1,800 cell-s queued; batch 1 launchable
    cells = [cell(i, T) for i in range(4)] + [cell(4)]
    s = state(cells, hosted={4: 1}, pending=[(1, 16)], version=0, eta=1, ready=1800.0, unended=1, now=100.0)
    eager = make_policy("elastic", prefetch="eager").decide(s)
    paced = make_policy("elastic", prefetch="paced", pace_s=1000.0).decide(s)
    assert sorted(of(SwitchToRollout, eager)) == [0, 1, 2, 3]  # the whole batch pulls every trainer back
    # paced: 1,800 cell-s due 900 s from now need ceil(1800 / 900) = 2 trainers; the other two come back
    assert sorted(of(SwitchToRollout, paced)) == [2, 3]
    late = make_policy("elastic", prefetch="paced", pace_s=50.0).decide(s)
    assert of(SwitchToRollout, late) == []  # the pace is past: everyone trains
    with pytest.raises(ValueError, match="pace_s"):
        make_policy("elastic", prefetch="paced", pace_s=0.0)


def test_trickle_prefetch_fills_only_the_cells_the_current_batch_needs() -> None:
    # one straggler of batch 0 on cell 1, cell 2 empty, nothing to train yet; batch 1 launchable
    cells = [cell(0, T), cell(1), cell(2)]
    s = state(cells, hosted={1: 1}, pending=[(1, 10)], version=0, eta=1, unended=1)
    spare = make_policy("elastic", prefetch="spare").decide(s)
    trickle = make_policy("elastic", prefetch="trickle").decide(s)
    assert sorted(of(Launch, spare)) == [1, 1, 1, 2, 2, 2, 2]  # spare fills every rollout cell
    assert of(Launch, trickle) == [1, 1, 1]  # trickle: only the straggler's cell, cell 2 stays free
    # with nothing of the trainable batch in flight, trickle fills every cell like spare
    s = state(cells, pending=[(1, 10)], version=0, eta=1, unended=0)
    assert len(of(Launch, make_policy("elastic", prefetch="trickle").decide(s))) == 8


def test_trickle_brings_an_idle_trainer_back_only_for_room_it_would_fill() -> None:
    # an idle trainer (nothing queued) and more of batch 1 launchable than the rollout cells hold
    cells = [cell(0, T), cell(1), cell(2)]
    s = state(cells, hosted={1: 1}, pending=[(1, 10)], version=0, eta=1, unended=1)
    spare = make_policy("elastic", prefetch="spare").decide(s)
    assert of(SwitchToRollout, spare) == [0]  # spare would place batch 1 on it: it comes back
    # trickle would not: batch 1 goes only into the straggler's cell, so a return is a switch for nothing
    assert of(SwitchToRollout, make_policy("elastic", prefetch="trickle").decide(s)) == []
    # once batch 0 has nothing in flight, trickle places later batches everywhere: the trainer comes back
    s = state(cells, pending=[(1, 10)], version=0, eta=1, unended=0)
    assert of(SwitchToRollout, make_policy("elastic", prefetch="trickle").decide(s)) == [0]


def test_decide_is_pure() -> None:
    """A decision depends on the state alone: the state is left as it was, and a policy that already
    decided (on this state or another) decides as a fresh one does."""
    s = state([cell(0), cell(1), cell(2)], hosted={0: 1, 1: 1}, pending=[(0, 3), (1, 2)], eta=1, ready=1e3)
    other = state([cell(0, T), cell(1), cell(2)], hosted={1: 4}, pending=[(0, 2), (1, 6)], eta=1, ready=50.0)
    for name in policy_names():

        def fresh(name: str = name):
            return make_policy(name, train_cells=1) if name == "async" else make_policy(name)

        before = copy.deepcopy(s)
        first = fresh().decide(s)
        assert first, f"{name}: this state calls for actions, or the comparison proves nothing"
        assert s == before, f"{name}: decide changed the state it was given"
        used = fresh()
        used.decide(other)
        used.decide(s)
        assert used.decide(s) == first == fresh().decide(copy.deepcopy(before)), name


# ----------------------------------------------------------------- colocate


def test_colocate_waits_for_the_last_execution() -> None:
    s = state([cell(0), cell(1)], hosted={1: 1}, ready=1e4)
    assert of(SwitchToTrain, make_policy("colocate").decide(s)) == []


def test_colocate_all_cells_train_when_the_batch_has_ended() -> None:
    s = state([cell(0), cell(1), cell(2)], ready=100.0, unended=0)
    assert of(SwitchToTrain, make_policy("colocate").decide(s)) == [0, 1, 2]


def test_colocate_all_cells_come_back_for_the_next_batch() -> None:
    cells = [cell(0, T), cell(1, T, micro_step_until=200.0)]
    s = state(cells, pending=[(1, 8)], version=1)
    assert of(SwitchToRollout, make_policy("colocate").decide(s)) == [0, 1]


# -------------------------------------------------------------------- async


def test_async_split_is_fixed() -> None:
    policy = make_policy("async", train_cells=2)
    assert policy.initial_roles(5) == [T, T, R, R, R]
    cells = [cell(0, T), cell(1, T), cell(2), cell(3), cell(4)]
    s = state(cells, hosted={2: 4}, pending=[(0, 30)], ready=1e4, eta=1)
    actions = policy.decide(s)
    assert not of(SwitchToTrain, actions) and not of(SwitchToRollout, actions)
    assert set(of(Launch, actions)) == {3, 4}


def test_async_split_must_leave_both_roles() -> None:
    with pytest.raises(ValueError, match="train_cells=4"):
        make_policy("async", train_cells=4).initial_roles(4)


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known: async, colocate, elastic"):
        make_policy("round-robin")


# ---------------------------------------------- what the real runtime relies on


def test_async_split_comes_from_config_with_half_the_cells_by_default() -> None:
    from gyre_ray.scheduling.config import SchedulerSection

    assert SchedulerSection().async_split(6) == 3 and SchedulerSection().async_split(3) == 1
    assert SchedulerSection(async_train_cells=2).async_split(6) == 2
    policy = make_policy("async", train_cells=SchedulerSection(async_train_cells=2).async_split(6))
    assert policy.initial_roles(6) == [T, T, R, R, R, R]


def test_async_never_switches_whatever_the_demand_or_backlog() -> None:
    policy = make_policy("async", train_cells=2)
    for hosted, pending, ready in (
        ({2: 4, 3: 4}, [(0, 9), (1, 9)], 0.0),
        ({}, [], 1e5),
        ({2: 1}, [(1, 3)], 5.0),
    ):
        cells = [cell(0, T), cell(1, T, micro_step_until=120.0), cell(2), cell(3)]
        actions = policy.decide(state(cells, hosted=hosted, pending=pending, eta=1, ready=ready))
        assert not of(SwitchToTrain, actions) and not of(SwitchToRollout, actions)


def test_elastic_brings_a_trainer_back_mid_step_when_eta_lets_the_next_batch_launch() -> None:
    # batch 0 still trains (backlog queued, two executions unended); version 0, eta 1: batch 1 may launch
    cells = [cell(0, T, micro_step_until=150.0), cell(1, T, micro_step_until=130.0), cell(2)]
    s = state(cells, hosted={2: 2}, pending=[(1, 6)], eta=1, ready=600.0, unended=2)
    assert of(SwitchToRollout, make_policy("elastic").decide(s)) == [1]
    assert of(SwitchToRollout, make_policy("elastic").decide(replace(s, staleness=0))) == []


def test_elastic_counts_calls_queued_beyond_capacity_as_returning_demand() -> None:
    cells = [cell(0, T, micro_step_until=150.0), cell(1, T), cell(2)]
    s = state(cells, hosted={2: 4}, ready=600.0, unended=4)
    policy = make_policy("elastic")
    assert of(SwitchToRollout, policy.decide(s)) == []
    assert of(SwitchToRollout, policy.decide(replace(s, queued_demand=3.0))) == [1]
    # nor does a rollout cell leave while calls queue
    s = state([cell(0, T), cell(1), cell(2)], hosted={1: 1, 2: 1}, ready=600.0, unended=2)
    assert of(SwitchToTrain, policy.decide(s)) == [1]
    assert of(SwitchToTrain, policy.decide(replace(s, queued_demand=3.0))) == []


@pytest.mark.parametrize(("switch_s", "switches"), [(1.0, True), (400.0, False)])
def test_elastic_weighs_the_measured_switch_cost_against_the_backlog(switch_s: float, switches: bool) -> None:
    # one trainer already; 600 cell-s queued: a second trainer gets 300 s of it, worth a switch of 2 s
    # (1 s each way) but not of 800 s
    s = state([cell(0, T, micro_step_until=150.0), cell(1), cell(2)], hosted={1: 1}, ready=600.0)
    s = replace(s, switch_to_train_s=switch_s, switch_to_rollout_s=switch_s)
    assert bool(of(SwitchToTrain, make_policy("elastic").decide(s))) is switches


def test_trickle_counts_an_execution_on_a_cell_out_of_rollout_once() -> None:
    """An execution booked on a lost (or training) cell is in flight and in `queued_demand` both: the
    trickle allowance counted it twice and let later batches fill a cell more than intended."""
    from gyre_ray.scheduling.elastic import _trickle_allowance
    from gyre_ray.scheduling.runtime import CellPhase, CellView, Costs, ExecutionLedger, build_state

    views = [CellView(f"cell-{i}", i, capacity=4.0, is_core=i == 0) for i in range(3)]
    views[2].enter(CellPhase.LOST, 0.0)
    ledger = ExecutionLedger.planned([0, 0, 0, 0, 1, 1])
    for exec_id, cell in ((0, 0), (1, 0), (2, 2), (3, 2)):  # two on the lost cell
        ledger.launch(exec_id, cell, 0.0)
    state = build_state(1.0, 0, 2, 1, views, ledger, 0, Costs())
    assert state.in_flight_demand(0) == 4.0 and state.queued_demand == 2.0
    # batch 0's 4 executions need one 4-slot cell, which holds 2: room for 2 of later batches
    assert _trickle_allowance(state, {}) == 2.0
