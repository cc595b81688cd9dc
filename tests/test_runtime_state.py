"""The pure half of the scheduler actor: the real system as a `SchedState` (several batches in flight under
eta), fed to the simulator's policies; and the report helpers (staleness, overlap, costs.json)."""

from __future__ import annotations

import json

import pytest

from gyre_ray.runtime.report import (
    COST_KEYS,
    overlap_seconds,
    recovery_lines,
    staleness_summary,
    utilisation,
    write_costs,
)
from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.scheduling.elastic import ElasticPolicy
from gyre_ray.scheduling.runtime import (
    CellPhase,
    CellView,
    Costs,
    ExecutionLedger,
    build_state,
    fit_ended_durations,
    migrate_executions,
    policy_from_section,
)
from gyre_ray.scheduling.state import Launch, Role, SwitchToRollout, SwitchToTrain

COSTS = Costs(switch_to_train_s=1.0, switch_to_rollout_s=0.5, micro_step_s=2.0)


def cells(n: int, capacity: float) -> list[CellView]:
    return [CellView(f"cell-{i}", i, capacity=capacity) for i in range(n)]


def ledger_with(total: int, hosted: dict[int, int], batch_of: list[int] | None = None) -> ExecutionLedger:
    ledger = ExecutionLedger.planned(batch_of or [0] * total)
    for exec_id, cell in hosted.items():
        ledger.launch(exec_id, cell, now=0.0)
    return ledger


def test_state_carries_loads_pending_work_and_switches() -> None:
    views = cells(2, 2.0)
    views[1].enter(CellPhase.TO_TRAIN, 9.5)
    ledger = ledger_with(5, {0: 0, 1: 0}, batch_of=[3] * 5)
    ledger.end(1)
    state = build_state(10.0, 3, 4, 1, views, ledger, queued_micro_batches=4, costs=COSTS)
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
    state = build_state(5.0, 0, 1, 0, views, ledger, queued_micro_batches=2, costs=COSTS)
    assert ElasticPolicy().decide(state) == [SwitchToTrain(0)]
    # the loop then re-hosts the core's execution on the cell that stays in rollout
    assert migrate_executions(ledger, 0, views) == {3: 1}
    assert sorted(ledger.on_cell(1)) == [1, 3] and ledger.on_cell(0) == []
    # no queued work: nothing worth switching for
    idle = build_state(5.0, 0, 1, 0, views, ledger_with(2, {0: 1}), queued_micro_batches=0, costs=COSTS)
    assert ElasticPolicy().decide(idle) == [Launch(1, 0)]


def test_elastic_keeps_cells_rolling_out_while_the_rest_could_not_hold_the_demand() -> None:
    views = cells(2, 1.0)
    ledger = ledger_with(3, {0: 0, 1: 1})
    state = build_state(5.0, 0, 1, 0, views, ledger, queued_micro_batches=3, costs=COSTS)
    assert not [a for a in ElasticPolicy().decide(state) if isinstance(a, SwitchToTrain)]


def test_elastic_brings_a_trainer_back_when_demand_returns() -> None:
    views = cells(2, 1.0)
    views[1].enter(CellPhase.TRAIN_IDLE, 0.0)
    ledger = ledger_with(3, {0: 0})  # two pending and no room left on cell-0
    state = build_state(1.0, 0, 1, 0, views, ledger, queued_micro_batches=0, costs=COSTS)
    assert SwitchToRollout(1) in ElasticPolicy().decide(state)


def test_queued_demand_counts_calls_waiting_in_engines_and_executions_with_no_room() -> None:
    views = cells(3, 2.0)
    views[2].enter(CellPhase.TRAIN_IDLE, 0.0)
    ledger = ledger_with(6, {0: 0, 1: 0, 2: 0, 3: 1, 4: 2})  # cell-0 over capacity, one left on a trainer
    state = build_state(1.0, 0, 1, 0, views, ledger, 0, COSTS, waiting_calls={0: 0, 1: 2, 2: 5})
    # 1 on the trainer + 2 calls waiting on cell-1 (the trainer's 5 do not count; cell-0's third
    # execution is in its load already)
    assert state.queued_demand == 3.0 and state.cells[0].load == 3.0
    assert build_state(1.0, 0, 1, 0, cells(2, 2.0), ledger_with(2, {0: 0}), 0, COSTS).queued_demand == 0.0


def test_elastic_brings_a_trainer_back_for_calls_queued_beyond_the_engines() -> None:
    views = cells(2, 2.0)
    views[1].enter(CellPhase.TRAIN_IDLE, 0.0)
    ledger = ledger_with(2, {0: 0, 1: 0})  # cell-0 is full, nothing pending
    quiet = build_state(1.0, 0, 1, 0, views, ledger, 0, COSTS, waiting_calls={0: 0})
    assert not [a for a in ElasticPolicy().decide(quiet) if isinstance(a, SwitchToRollout)]
    busy = build_state(1.0, 0, 1, 0, views, ledger, 0, COSTS, waiting_calls={0: 1})
    assert SwitchToRollout(1) in ElasticPolicy().decide(busy)


def test_colocate_trains_on_every_cell_once_the_rollout_is_over() -> None:
    section = SchedulerSection(policy="colocate")
    views = cells(3, 2.0)
    ledger = ledger_with(2, {0: 0, 1: 1})
    for e in (0, 1):
        ledger.end(e)
    state = build_state(3.0, 0, 1, 0, views, ledger, queued_micro_batches=1, costs=COSTS)
    assert policy_from_section(section, 3).decide(state) == [
        SwitchToTrain(0),
        SwitchToTrain(1),
        SwitchToTrain(2),
    ]


def test_policies_are_built_from_the_scheduler_section_like_the_simulator() -> None:
    elastic = policy_from_section(SchedulerSection(policy="elastic", elastic_repay_factor=2.0), 2)
    assert isinstance(elastic, ElasticPolicy) and elastic.repay_factor == 2.0
    paced = policy_from_section(SchedulerSection(elastic_prefetch="paced", elastic_pace_s=1200.0), 2)
    assert isinstance(paced, ElasticPolicy) and (paced.prefetch, paced.pace_s) == ("paced", 1200.0)
    fixed = policy_from_section(SchedulerSection(policy="async"), 4)
    assert fixed.initial_roles(4) == [Role.TRAIN, Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT]


def test_later_batches_are_pending_and_launch_only_within_the_staleness_bound() -> None:
    views = cells(2, 4.0)
    ledger = ledger_with(6, {0: 0, 1: 1}, batch_of=[0, 0, 1, 1, 2, 2])
    on_policy = build_state(1.0, 0, 3, 0, views, ledger, 0, COSTS)
    assert on_policy.pending_demand == {1: 2.0, 2: 2.0} and on_policy.unended_in_trainable == 2
    assert not [a for a in ElasticPolicy().decide(on_policy) if isinstance(a, Launch)]  # eta 0: wait
    eta1 = build_state(1.0, 0, 3, 1, views, ledger, 0, COSTS)
    launched = sorted(a.exec_id for a in ElasticPolicy().decide(eta1) if isinstance(a, Launch))
    assert launched == [2, 3]  # batch 1 may launch under version 0, batch 2 may not
    assert state_cells(build_state(1.0, 0, 3, 1, views, ledger, 5, COSTS, updating=True)) == 0.0


def state_cells(state) -> float:
    return state.ready_work_s  # no trainable work while the update is running


def test_phases_map_to_roles_and_readiness() -> None:
    assert [p.role for p in CellPhase] == [
        Role.ROLLOUT, Role.TRAIN, Role.TRAIN, Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT
    ]  # fmt: skip
    assert not CellView("cell-1", 1, phase=CellPhase.LOST).ready
    view = CellView("cell-0", 0)
    view.enter(CellPhase.TRAINING, 2.0)
    state = build_state(2.5, 0, 1, 0, [view], ledger_with(1, {}), 0, COSTS)
    assert state.cells[0].micro_step_until == 4.0 and state.cells[0].ready  # since 2.0 + 2 s micro-step


def test_staleness_histogram_and_overlap() -> None:
    summary = staleness_summary(3, [{3: 10, 2: 30}, {2: 10}])
    assert summary["hist"] == {"0": 10, "1": 40} and summary["max"] == 1
    assert summary["mean"] == 0.8 and summary["tokens"] == 50
    assert overlap_seconds([(0.0, 10.0)], [(2.0, 4.0), (3.0, 5.0), (9.0, 12.0)]) == 4.0
    assert overlap_seconds([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def test_utilisation_shares_sum_to_one() -> None:
    share = utilisation(
        [("c0", "rollout", 0.0, 6.0), ("c0", "training", 6.0, 9.0), ("c0", "switching", 9.0, 10.0)], 10.0
    )
    assert share["c0"] == {"rollout": 0.6, "training": 0.3, "switching": 0.1, "idle": 0.0}


def test_costs_file_has_exactly_the_contract_keys(tmp_path) -> None:
    costs = dict.fromkeys(COST_KEYS, 1.0) | {"extra": 2}
    path = write_costs(tmp_path, costs)
    assert list(json.loads(path.read_text())) == list(COST_KEYS)
    del costs["makespan_s"]
    with pytest.raises(KeyError, match="makespan_s"):
        write_costs(tmp_path, costs)


PRIOR_HOURS = {"mu_log_hours": -0.916, "sigma_log_hours": 0.55, "rho": 0.6, "timeout_hours": 1.5}


def test_the_sibling_launch_order_is_configured_with_its_prior_or_refused() -> None:
    section = SchedulerSection(elastic_launch_order="sibling", elastic_duration_prior=PRIOR_HOURS)
    policy = policy_from_section(section, 2)
    assert isinstance(policy, ElasticPolicy) and policy.launch_order == "sibling"
    assert section.duration_prior().timeout_s == pytest.approx(5400.0)
    with pytest.raises(
        ValueError, match="elastic_launch_order=sibling needs scheduler.elastic_duration_prior"
    ):
        SchedulerSection(elastic_launch_order="sibling")
    with pytest.raises(ValueError, match="rho"):
        SchedulerSection(elastic_duration_prior={**PRIOR_HOURS, "rho": 1.0})
    assert policy_from_section(SchedulerSection(), 2).launch_order == "fifo"


def test_the_state_carries_each_tasks_history_and_the_sibling_order_uses_it() -> None:
    # 2 tasks of 3 executions in batch 0: task 0 = executions 0-2, task 1 = 3-5
    ledger = ExecutionLedger.planned([0] * 6, [0, 0, 0, 1, 1, 1])
    ledger.launch(0, 0, now=0.0)
    ledger.launch(3, 0, now=0.0)
    ledger.end(0, ran_s=120.0)  # task 0's first execution ended after 2 minutes: a short task
    state = build_state(3600.0, 0, 2, 1, cells(1, 2.0), ledger, 0, COSTS)
    assert state.group_running == {1: {3: 0.0}}
    assert [(e.ran_s, e.timed_out) for e in state.group_ended[0]] == [(120.0, False)]
    assert [p.group for p in state.pending] == [0, 0, 1, 1] and state.in_flight[3].group == 1
    section = SchedulerSection(elastic_launch_order="sibling", elastic_duration_prior=PRIOR_HOURS)
    sibling = policy_from_section(section, 1).decide(state)
    fifo = policy_from_section(SchedulerSection(), 1).decide(state)
    # one free slot: FIFO launches task 0's next execution, the sibling order task 1's (running for 1 h)
    assert [a.exec_id for a in fifo if isinstance(a, Launch)] == [1]
    assert [a.exec_id for a in sibling if isinstance(a, Launch)] == [4]


def test_a_ledger_without_tasks_gives_no_history() -> None:
    ledger = ledger_with(3, {0: 0})
    ledger.end(0, ran_s=5.0, timed_out=True)
    state = build_state(10.0, 0, 1, 0, cells(1, 2.0), ledger, 0, COSTS)
    assert state.group_ended == {} and state.group_running == {}
    assert {p.group for p in state.pending} == {-1}
    with pytest.raises(ValueError, match="group_of has 2 entries for 3 executions"):
        ExecutionLedger.planned([0, 0, 0], [0, 1])


def test_an_auto_prior_launches_fifo_until_the_runs_own_fit_then_sibling() -> None:
    section = SchedulerSection(elastic_launch_order="sibling", elastic_duration_prior="auto")
    assert section.fits_duration_prior and section.duration_prior() is None
    assert policy_from_section(section, 2).launch_order == "fifo"  # nothing ended yet
    ledger = ExecutionLedger.planned([0] * 6, [0, 0, 0, 1, 1, 1])
    for e, ran_s in enumerate([100.0, 150.0, 120.0, 900.0, 1500.0, 5400.0]):
        ledger.launch(e, 0, now=0.0)
        ledger.end(e, ran_s=ran_s, timed_out=ran_s >= 5400.0)
    fit = fit_ended_durations(ledger)
    assert (fit.executions, fit.tasks, fit.timed_out) == (6, 2, 1)
    assert fit.timeout_hours == pytest.approx(1.5)
    policy = policy_from_section(section, 2, fit.prior())
    assert isinstance(policy, ElasticPolicy) and policy.launch_order == "sibling"
    configured = SchedulerSection(elastic_launch_order="sibling", elastic_duration_prior=PRIOR_HOURS)
    assert not configured.fits_duration_prior  # a configured prior is kept, never refitted


def test_the_runs_fit_reads_the_latest_tasks_and_says_why_it_cannot_fit_yet() -> None:
    ledger = ExecutionLedger.planned([0] * 4, [0, 0, 1, 1])
    ledger.launch(0, 0, now=0.0)
    ledger.end(0, ran_s=60.0)
    with pytest.raises(ValueError, match="two tasks with two or more executions"):
        fit_ended_durations(ledger)
    many = ExecutionLedger.planned([0] * 40, [e // 4 for e in range(40)])
    for e in range(40):
        many.launch(e, 0, now=0.0)
        many.end(e, ran_s=60.0 + e)
    assert fit_ended_durations(many, limit=12).tasks == 3  # the last three tasks' 12 executions


def test_what_a_run_recovered_from_is_one_line_per_kind() -> None:
    assert recovery_lines({"faults": [], "runner_losses": [], "scheduler_restarts": []}) == []
    summary = {
        "faults": [
            {"cell": "cell-1", "lost": "ActorDiedError"},
            {"cell": "cell-1", "lost": "ActorDiedError"},
            {"cell": "cell-2", "lost": "ActorDiedError"},
            {"actor": "workers", "group_processed_again": "s3-vowels"},
        ],
        "runner_losses": [
            {"runner": None, "actor": "workers"},
            {"runner": 1, "actor": "runner-1"},
            {"runner": 1},  # journaled before losses named the actor
        ],
        "scheduler_restarts": [{"executions_reattached": 3, "executions_relaunched": 1}],
    }
    assert recovery_lines(summary) == [
        "cells lost and restarted: cell-1 x2, cell-2 x1",
        "3 execution(s) started again after their executor died (runner-1 x2, workers x1)",
        "1 group(s) processed again after `workers` died: s3-vowels",
        "scheduler actor restarted 1 time(s): 3 execution(s) reattached, 1 started again",
    ]
