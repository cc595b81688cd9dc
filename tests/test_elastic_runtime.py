"""The pure half of the Ray scheduler loop: the real system as a `SchedState`, fed to the simulator's policies."""

from __future__ import annotations

import pytest

from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.scheduling.elastic import ElasticPolicy
from gyre_ray.scheduling.runtime import (
    CellView,
    Costs,
    ExecutionLedger,
    build_state,
    migrate_executions,
    policy_from_section,
)
from gyre_ray.scheduling.state import Launch, Role, SwitchToRollout, SwitchToTrain

COSTS = Costs(switch_to_train_s=1.0, switch_to_rollout_s=0.5, micro_step_s=2.0)


def cells(n: int, capacity: float) -> list[CellView]:
    return [CellView(f"cell-{i}", i, capacity=capacity) for i in range(n)]


def ledger_with(total: int, hosted: dict[int, int]) -> ExecutionLedger:
    ledger = ExecutionLedger.planned(total)
    for exec_id, cell in hosted.items():
        ledger.launch(exec_id, cell, now=0.0)
    return ledger


def test_state_carries_loads_pending_work_and_switches() -> None:
    views = cells(2, 2.0)
    views[1].role, views[1].switching_since = Role.TRAIN, 9.5
    views[0].training_since = None
    ledger = ledger_with(5, {0: 0, 1: 0})
    ledger.end(1)
    state = build_state(10.0, 3, 1, views, ledger, queued_micro_batches=4, costs=COSTS)
    assert state.policy_version == 3 and state.steps_total == 4
    assert [c.load for c in state.cells] == [1.0, 0.0]
    assert list(state.in_flight) == [0] and state.in_flight[0].batch == 3
    assert [p.exec_id for p in state.pending] == [2, 3, 4] and state.pending_demand == {3: 3.0}
    assert state.ready_work_s == pytest.approx(8.0) and state.unended_in_trainable == 4
    assert state.cells[1].switching_until == pytest.approx(10.5)  # started 9.5, expected 1 s
    assert not state.cells[1].ready and state.cells[0].ready


def test_elastic_switches_the_core_when_the_other_cell_can_carry_its_executions() -> None:
    views = cells(2, 2.0)
    ledger = ledger_with(5, {0: 0, 1: 1, 2: 0, 3: 0, 4: 1})
    for e in (0, 2, 4):  # the first group ended; its micro-batches are queued
        ledger.end(e)
    state = build_state(5.0, 0, 0, views, ledger, queued_micro_batches=2, costs=COSTS)
    assert ElasticPolicy().decide(state) == [SwitchToTrain(0)]
    # the loop then re-hosts the core's execution on the cell that stays in rollout
    assert migrate_executions(ledger, 0, views) == {3: 1}
    assert sorted(ledger.on_cell(1)) == [1, 3] and ledger.on_cell(0) == []
    # no queued work: nothing worth switching for
    idle = build_state(5.0, 0, 0, views, ledger_with(2, {0: 1}), queued_micro_batches=0, costs=COSTS)
    assert ElasticPolicy().decide(idle) == [Launch(1, 0)]


def test_elastic_keeps_cells_rolling_out_while_the_rest_could_not_hold_the_demand() -> None:
    views = cells(2, 1.0)
    ledger = ledger_with(3, {0: 0, 1: 1})
    state = build_state(5.0, 0, 0, views, ledger, queued_micro_batches=3, costs=COSTS)
    assert not [a for a in ElasticPolicy().decide(state) if isinstance(a, SwitchToTrain)]


def test_elastic_brings_a_trainer_back_when_demand_returns() -> None:
    views = cells(2, 1.0)
    views[1].role = Role.TRAIN
    ledger = ledger_with(3, {0: 0})  # two pending and no room left on cell-0
    state = build_state(1.0, 0, 0, views, ledger, queued_micro_batches=0, costs=COSTS)
    assert SwitchToRollout(1) in ElasticPolicy().decide(state)


def test_colocate_trains_on_every_cell_once_the_rollout_is_over() -> None:
    section = SchedulerSection(policy="colocate")
    views = cells(3, 2.0)
    ledger = ledger_with(2, {0: 0, 1: 1})
    for e in (0, 1):
        ledger.end(e)
    state = build_state(3.0, 0, 0, views, ledger, queued_micro_batches=1, costs=COSTS)
    assert policy_from_section(section, 3).decide(state) == [
        SwitchToTrain(0),
        SwitchToTrain(1),
        SwitchToTrain(2),
    ]


def test_policies_are_built_from_the_scheduler_section_like_the_simulator() -> None:
    elastic = policy_from_section(SchedulerSection(policy="elastic", elastic_repay_factor=2.0), 2)
    assert isinstance(elastic, ElasticPolicy) and elastic.repay_factor == 2.0
    fixed = policy_from_section(SchedulerSection(policy="async"), 4)
    assert fixed.initial_roles(4) == [Role.TRAIN, Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT]
