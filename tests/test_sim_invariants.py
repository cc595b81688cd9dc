"""Simulator invariants on every policy: roles never overlap, work is conserved, executions end once,
staleness holds, makespans respect the lower bound; plus the mechanics the policies rely on."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gyre_ray.scheduling.base import Policy
from gyre_ray.scheduling.state import Launch, Role, SchedState, SwitchToRollout, SwitchToTrain
from gyre_ray.sim.bound import lower_bound, rollout_role_lower_bound
from gyre_ray.sim.engine import SimCosts, SimulationError, Simulator
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import run_policy
from gyre_ray.sim.timeline import SimResult
from gyre_ray.sim.workload import DurationModel, SampledWorkload, WorkloadSpec, sample_workload

TOL = 1e-6


def small_spec(**kw) -> WorkloadSpec:
    base = dict(
        name="small",
        tasks_per_step=4,
        group_size=4,
        duration=DurationModel(mu_log_hours=-1.0, sigma_log_hours=0.8, rho=0.5, timeout_hours=1.0),
        train_cluster_s_per_trajectory=40.0,
    )
    base.update(kw)
    return WorkloadSpec(**base)


def check_invariants(result: SimResult, wl: SampledWorkload, n_cells: int, eta: int) -> None:
    tl = result.timeline
    makespan = result.makespan_s
    capacity = wl.capacity_per_cell(n_cells)
    # one role at a time: each cell's segments tile [0, makespan] without gaps or overlaps
    for segments in tl.segments:
        assert segments[0][0] == 0.0 and segments[-1][1] == pytest.approx(makespan)
        for (_, end, _), (start, _, _) in zip(segments, segments[1:], strict=False):
            assert end == pytest.approx(start)
        assert all(s <= e for s, e, _ in segments)

    def inside(cell: int, start: float, end: float, kind: str) -> bool:
        return any(s - TOL <= start and end <= e + TOL for s, e, k in tl.segments[cell] if k == kind)

    # micro-steps only on ready trainers, executions only on ready rollout cells, never over capacity
    assert all(inside(c, s, e, "train") for c, s, e, _, _ in tl.micros)
    assert all(inside(int(c), s, e, "rollout") for _, c, s, e in tl.hosting)
    assert all(load <= capacity + TOL for loads in tl.loads for _, load in loads)
    # every execution ends exactly once, after running its duration plus its pauses
    assert tl.end_count == [1] * wl.n_executions
    hosted = np.zeros(wl.n_executions)
    for e, _, s, end in tl.hosting:
        hosted[int(e)] += end - s
    np.testing.assert_allclose(hosted, wl.duration_s + np.asarray(tl.delay_s), rtol=1e-9, atol=1e-6)
    # staleness: launched under a version at most eta behind, never ahead
    lag = wl.batch - np.asarray(tl.launch_version)
    assert lag.min() >= 0 and lag.max() <= eta
    # work conserved: per batch, trained == released == the workload's training work
    work = np.bincount(wl.batch, weights=wl.train_cell_s(n_cells), minlength=wl.steps)
    np.testing.assert_allclose(tl.released, work, rtol=1e-9)
    np.testing.assert_allclose(tl.trained, work, rtol=1e-9)
    # training of batch b runs between update b-1 and update b, on work already released
    updates = [0.0] + tl.update_times
    assert len(tl.update_times) == wl.steps and tl.update_times == sorted(tl.update_times)
    for _cell, start, end, batch, amount in tl.micros:
        assert updates[batch] - TOL <= start and end <= updates[batch + 1] + TOL
        assert end - start == pytest.approx(amount)
    for batch in range(wl.steps):
        released = np.array(sorted((t, w) for b, t, w in tl.release_events if b == batch)).reshape(-1, 2)
        claims = np.array(sorted((s, w) for _, s, _, b, w in tl.micros if b == batch)).reshape(-1, 2)
        claimed_so_far = np.cumsum(claims[:, 1])
        released_by = np.cumsum(released[:, 1])[
            np.searchsorted(released[:, 0], claims[:, 0], side="right") - 1
        ]
        assert np.all(claimed_so_far <= released_by + 1e-6)
    # and no schedule beats the bound
    assert makespan >= result.lower_bound_s * (1 - 1e-12)


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize(
    "policy,knobs",
    [
        ("colocate", {}),
        ("async", {"train_cells": 1}),
        ("async", {"train_cells": 2}),
        ("elastic", {"prefetch": "eager"}),
        ("elastic", {"prefetch": "spare"}),
        ("elastic", {"prefetch": "paced", "pace_s": 1800.0}),
        ("elastic", {"prefetch": "trickle"}),
        ("elastic", {"repay_factor": 0.0}),
    ],
)
def test_invariants_hold_for_every_policy(policy: str, knobs: dict, eta: int) -> None:
    wl = sample_workload(small_spec(demand_sigma=0.4, capacity_executions=24), steps=5, seed=eta)
    result = run_policy(wl, policy, 3, eta, record=True, **knobs)
    check_invariants(result, wl, 3, 0 if policy == "colocate" else eta)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tasks=st.integers(1, 4),
    group=st.integers(1, 4),
    steps=st.integers(1, 4),
    cells=st.integers(2, 4),
    eta=st.integers(0, 2),
    sigma=st.floats(0.0, 1.5),
    capacity_factor=st.floats(0.3, 2.0),
    demand_sigma=st.sampled_from([0.0, 0.5]),
    train_cost=st.floats(1.0, 400.0),
    micro_step=st.floats(5.0, 200.0),
    untrained_batch=st.integers(-1, 3),
    seed=st.integers(0, 10_000),
)
def test_invariants_hold_on_random_workloads(
    tasks, group, steps, cells, eta, sigma, capacity_factor, demand_sigma, train_cost, micro_step,
    untrained_batch, seed,
) -> None:  # fmt: skip
    spec = small_spec(
        tasks_per_step=tasks,
        group_size=group,
        duration=DurationModel(mu_log_hours=-1.5, sigma_log_hours=sigma, rho=0.5, timeout_hours=0.8),
        train_cluster_s_per_trajectory=train_cost,
        capacity_executions=max(1.0, capacity_factor * tasks * group),
        demand_sigma=demand_sigma,
    )
    wl = sample_workload(spec, steps, seed)
    assume(wl.demand.max() <= wl.capacity_per_cell(cells))
    wl.trajectories[wl.batch == untrained_batch] = 0  # a batch of advantage 0 only: nothing to train
    costs = SimCosts(micro_step_s=micro_step)
    for policy, knobs in [
        ("colocate", {}),
        ("async", {"train_cells": 1 + seed % (cells - 1)}),
        (
            "elastic",
            {"prefetch": ("eager", "spare", "paced", "trickle")[seed % 4], "pace_s": 600.0 + seed % 3000},
        ),
    ]:
        result = run_policy(wl, policy, cells, eta, costs, record=True, **knobs)
        check_invariants(result, wl, cells, 0 if policy == "colocate" else eta)


def test_colocate_costs_exactly_last_end_plus_training_plus_switches() -> None:
    wl = sample_workload(small_spec(), steps=4, seed=3)
    costs = SimCosts()
    cells = 4
    result = run_policy(wl, "colocate", cells, 0, costs)
    last_end = sum(wl.duration_s[wl.batch == s].max() for s in range(wl.steps))
    training = wl.train_cell_s(cells).sum() / cells
    per_update = costs.switch_to_train_s + (cells - 1) * costs.grad_sync_s + costs.optimizer_step_s
    expected = last_end + training + wl.steps * per_update + (wl.steps - 1) * costs.switch_to_rollout_s
    assert result.makespan_s == pytest.approx(expected)
    assert result.switches == 2 * wl.steps * cells - cells  # no switch back after the last update


def test_elastic_is_never_slower_than_colocate_on_presets() -> None:
    for name in ("nl2repo", "terminal", "nl2repo-hard"):
        wl = sample_workload(PRESETS[name].model_copy(update={"tasks_per_step": 16}), steps=3, seed=1)
        colocate = run_policy(wl, "colocate", 4, 0)
        elastic = run_policy(wl, "elastic", 4, 0)
        assert elastic.makespan_s <= colocate.makespan_s
        assert elastic.lower_bound_s == colocate.lower_bound_s


def test_elastic_trains_while_the_batch_still_rolls_out() -> None:
    wl = sample_workload(PRESETS["nl2repo"].model_copy(update={"tasks_per_step": 16}), steps=3, seed=4)
    result = run_policy(wl, "elastic", 4, 0, record=True)
    tl = result.timeline
    for batch in range(wl.steps):
        last_end = max(tl.end_time[e] for e in np.flatnonzero(wl.batch == batch))
        early = {cell for cell, start, _, b, _ in tl.micros if b == batch and start < last_end}
        assert 0 in early and len(early) >= 2  # the core and at least one satellite joined mid-step


class _Scripted(Policy):
    """Rolls out on cell 0, trains on cell 1 once work is queued, asks it back mid-micro-step at t >= 1 h."""

    name = "scripted"
    requested_at: float | None = None

    def decide(self, state: SchedState):
        actions = []
        c1 = state.cells[1]
        may_train = state.now < 3600 or not state.in_flight
        if c1.role is Role.ROLLOUT and c1.ready and state.ready_work_s > 0 and may_train:
            actions.append(SwitchToTrain(1))
        busy = c1.role is Role.TRAIN and c1.micro_step_until is not None
        if busy and state.now >= 3600 and not c1.return_requested and self.requested_at is None:
            actions.append(SwitchToRollout(1))
            self.requested_at = state.now
        room = state.cells[0].free_capacity
        for item in state.pending:
            if item.batch > state.policy_version or room < item.demand:
                break
            actions.append(Launch(item.exec_id, 0))
            room -= item.demand
        return actions


def test_a_returning_trainer_finishes_its_micro_step_first() -> None:
    spec = small_spec(
        tasks_per_step=2,
        group_size=1,
        duration=DurationModel(mu_log_hours=0.0, sigma_log_hours=0.0, rho=0.0, timeout_hours=10.0),
        train_cluster_s_per_trajectory=3000.0,
        capacity_executions=4,
    )
    wl = sample_workload(spec, steps=1)
    wl.duration_s[:] = [600.0, 4000.0]  # group 0 ends at 600 s; group 1 keeps the step open
    policy = _Scripted()
    result = Simulator(wl, policy, 2, 0, SimCosts(micro_step_s=1000.0), record=True).run()
    asked = policy.requested_at
    assert asked is not None
    running = [end for cell, start, end, _, _ in result.timeline.micros if cell == 1 and start < asked < end]
    to_rollout = [s for s, _, k in result.timeline.segments[1] if k == "to_rollout"]
    assert len(running) == 1 and running[0] > asked
    assert to_rollout == [pytest.approx(running[0])]


class _Rogue(Policy):
    name = "rogue"

    def __init__(self, action):
        self.action, self.done = action, False

    def decide(self, state):
        if self.done:
            return []
        self.done = True
        return [self.action(state)]


@pytest.mark.parametrize(
    "make_action,message",
    [
        (
            lambda s: Launch(next(p for p in s.pending if p.batch == 2).exec_id, 0),
            "exceeds the staleness bound",
        ),
        (lambda s: SwitchToRollout(0), "not a trainer"),
        (lambda s: Launch(10**6, 0), "not pending"),
        (lambda s: SwitchToTrain(7), "no cell 7"),
    ],
)
def test_the_simulator_rejects_impossible_actions(make_action, message) -> None:
    wl = sample_workload(small_spec(), steps=3)
    with pytest.raises(SimulationError, match=message):
        Simulator(wl, _Rogue(make_action), 2, 1).run()


def test_a_switch_whose_executions_cannot_migrate_is_rejected() -> None:
    class Overfull(Policy):
        name = "overfull"

        def decide(self, state):
            if state.now == 0:
                launches = [Launch(p.exec_id, i % 2) for i, p in enumerate(list(state.pending)[:16])]
                return [*launches, SwitchToTrain(0)]
            return []

    wl = sample_workload(small_spec(capacity_executions=16), steps=1)
    with pytest.raises(SimulationError, match="do not fit"):
        Simulator(wl, Overfull(), 2, 0).run()


def test_a_stalled_run_says_why() -> None:
    class Idle(Policy):
        name = "idle"

        def decide(self, state):
            return []

    with pytest.raises(SimulationError, match="stalled at t=0.0s, version 0/2"):
        Simulator(sample_workload(small_spec(), steps=2), Idle(), 2, 0).run()


def test_the_bound_is_the_reference_formula_for_one_on_policy_step() -> None:
    spec = small_spec(
        tasks_per_step=3, group_size=1, train_cluster_s_per_trajectory=100.0, capacity_executions=30
    )
    wl = sample_workload(spec, steps=1)
    wl.duration_s[:] = [100.0, 1000.0, 5000.0]
    wl.trajectories[:] = [1, 2, 1]
    cells = 2
    work = wl.train_cell_s(cells)  # 200, 400, 200 cell-seconds
    chain = max(t + work[wl.duration_s >= t].sum() / cells for t in wl.duration_s)
    bound = lower_bound(wl, cells, 0, optimizer_step_s=7.0)
    assert bound.chain_s == pytest.approx(chain + 7.0) and bound.chain_s == pytest.approx(5107.0)
    # rollout needs max(fluid cell-seconds, the longest execution) on-policy, the fluid part only with eta >= 1
    fluid = wl.duration_s.sum() / 15.0
    assert bound.work_s == pytest.approx((max(fluid, 5000.0) + work.sum()) / cells + 7.0)
    assert bound.total_s == max(bound.chain_s, bound.work_s)
    # one batch: whatever eta, a cell rolls out while its longest execution runs
    assert lower_bound(wl, cells, 1, optimizer_step_s=7.0).work_s == pytest.approx(bound.work_s)


def _two_step_workload():
    spec = small_spec(
        tasks_per_step=3, group_size=1, train_cluster_s_per_trajectory=100.0, capacity_executions=30
    )
    wl = sample_workload(spec, steps=2)
    wl.duration_s[:] = [100.0, 1000.0, 5000.0, 100.0, 200.0, 300.0]
    wl.trajectories[:] = 1
    return wl


def test_the_rollout_role_term_counts_each_class_of_batches_that_cannot_overlap() -> None:
    wl = _two_step_workload()  # 2 cells of 15 slots: batch 0 rolls out 6100 / 15, batch 1 600 / 15
    r0, r1 = 6100.0 / 15, 600.0 / 15
    rollout, longest = np.array([r0, r1]), np.array([5000.0, 300.0])
    # eta = 0: batches roll out one after the other, each for at least its longest execution
    assert rollout_role_lower_bound(rollout, longest, 0) == pytest.approx(5000.0 + 300.0)
    # eta = 1: batch 1 may roll out inside batch 0's 5000 s window, so only batch 0's window counts
    assert rollout_role_lower_bound(rollout, longest, 1) == pytest.approx(max(r0 + r1, 5000.0))
    # the whole work part holds at least that rollout role plus the training, at each eta
    work = wl.train_cell_s(2).sum()  # 6 x 200 cell-seconds
    eta0, eta1 = lower_bound(wl, 2, 0), lower_bound(wl, 2, 1)
    assert eta0.work_s >= (5000.0 + 300.0 + work) / 2
    assert eta1.work_s >= (5000.0 + work) / 2
    assert eta1.total_s <= eta0.total_s


def test_the_work_part_counts_cells_that_cannot_work_before_the_first_update() -> None:
    # 8 cells, a 5000 s execution: update 0 ends after 5000 s + its group's training; until then only
    # batches 0 and 1 (eta = 1) can roll out and only batch 0 can train, far less than 8 x 5000 cell-s
    wl = _two_step_workload()
    cells = 8
    bound = lower_bound(wl, cells, 1)
    per_cell = 30 / cells
    rollout = wl.duration_s.sum() / per_cell
    train = wl.train_cell_s(cells)
    available = rollout + train[:3].sum()  # all of batch 0 and batch 1's rollout
    idle = cells * bound.update_s[0] - available
    assert idle > 0
    assert bound.work_s == pytest.approx((rollout + train.sum() + idle) / cells)
    # the makespan of every policy respects it
    for policy in ("colocate", "elastic"):
        assert run_policy(wl, policy, cells, 1).makespan_s >= bound.work_s


def test_the_bound_counts_the_cell_that_hosts_the_longest_execution() -> None:
    # executions of 100 s and 1000 s, 1000 cell-s of training each, 2 cells: the 100 s group's work
    # cannot use both cells while the 1000 s execution runs, so (2000 + 900) / 2 after t = 100 s.
    # This schedule reaches it: cell A hosts the long one; cell B trains from 100 s; from 1000 s
    # both train the 1100 cell-s left: 1000 + 550 = 1550 s (t + W / C alone would say 1500 s).
    spec = small_spec(
        tasks_per_step=2, group_size=1, train_cluster_s_per_trajectory=500.0, capacity_executions=2
    )
    wl = sample_workload(spec, steps=1)
    wl.duration_s[:] = [100.0, 1000.0]
    wl.trajectories[:] = [1, 1]
    assert lower_bound(wl, 2, 0).chain_s == pytest.approx(1550.0)
    free = SimCosts(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, micro_step_s=1.0)
    for policy in ("elastic", "colocate"):
        assert run_policy(wl, policy, 2, 0, free).makespan_s >= 1550.0 - 1e-6
    assert run_policy(wl, "elastic", 2, 0, free).makespan_s == pytest.approx(1550.0, abs=2.0)


def test_more_staleness_never_raises_the_bound() -> None:
    wl = sample_workload(PRESETS["nl2repo"].model_copy(update={"tasks_per_step": 8}), steps=6, seed=2)
    bounds = [lower_bound(wl, 4, eta).total_s for eta in range(4)]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] > bounds[-1]


def test_48_steps_of_1024_executions_on_8_cells_simulate_in_under_30_s() -> None:
    wl = sample_workload(PRESETS["nl2repo"], steps=48, seed=0)
    assert wl.n_executions == 48 * 1024
    start = time.perf_counter()
    result = run_policy(wl, "elastic", 8, 1)
    elapsed = time.perf_counter() - start
    assert math.isfinite(result.makespan_s) and len(result.update_times) == 48
    assert elapsed < 30.0, f"took {elapsed:.1f} s"


def test_a_batch_with_nothing_to_train_takes_no_optimizer_step_in_the_run_or_the_bound() -> None:
    """Every execution of advantage 0 (a replayed trace): the runtime skips the optimizer step and
    publishes nothing, so the simulator charges neither and the bound (which must stay below every
    schedule) leaves the step out too."""
    spec = small_spec(tasks_per_step=2, group_size=2, train_cluster_s_per_trajectory=100.0)
    wl = sample_workload(spec, steps=2, seed=1)
    wl.duration_s[:] = [300.0, 500.0, 200.0, 400.0, 100.0, 600.0, 250.0, 350.0]
    wl.trajectories[:] = [1, 1, 1, 1, 0, 0, 0, 0]  # batch 1: nothing to train
    costs = SimCosts(optimizer_step_s=7.0)
    bound = lower_bound(wl, 2, 0, optimizer_step_s=7.0)
    # batch 0: from its group that ends at 400 s, 800 cell-seconds of work and the rest of the 500 s
    # execution on 2 cells, then the step; batch 1: its longest execution, then no step
    assert bound.update_s == pytest.approx((857.0, 857.0 + 600.0))
    result = run_policy(wl, "colocate", 2, 0, costs)
    per_update = costs.switch_to_train_s + costs.grad_sync_s + costs.optimizer_step_s
    batch_0 = 500.0 + 800.0 / 2 + per_update + costs.switch_to_rollout_s
    assert result.makespan_s == pytest.approx(batch_0 + 600.0)  # no switch, no step, for batch 1
    assert result.makespan_s >= bound.total_s
