"""Sibling launch order (`gyre_ray.scheduling.launch_order`): ranking rules on hand-built states, and in the simulator."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from gyre_ray.scheduling.base import make_policy
from gyre_ray.scheduling.launch_order import DurationPrior, SiblingOrder
from gyre_ray.scheduling.state import (
    CellState,
    EndedExecution,
    Launch,
    PendingExecution,
    Role,
    SchedState,
)
from gyre_ray.sim.engine import SimCosts, Simulator
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.workload import sample_workload

# nl2repo's model: median 0.4 h, sigma 0.55, rho 0.6, timeout 1.5 h
PRIOR = DurationPrior.from_hours(-0.916, 0.55, 0.6, 1.5)
HOUR = 3600.0


def state(
    pending: list[tuple[int, int, int]],
    ended: dict[int, list[EndedExecution]] | None = None,
    running: dict[int, dict[int, float]] | None = None,
    now: float = HOUR,
    version: int = 0,
    eta: int = 1,
) -> SchedState:
    """`pending`: (exec id, batch, group) in id order."""
    items = [PendingExecution(e, b, 1.0, g) for e, b, g in pending]
    demand = {b: float(n) for b, n in Counter(item.batch for item in items).items()}
    return SchedState(
        now=now,
        policy_version=version,
        steps_total=10,
        staleness=eta,
        cells=(CellState(0, Role.ROLLOUT, 2.0),),
        in_flight={},
        in_flight_by_cell={0: {}},
        pending=items,
        pending_demand=demand,
        ready_work_s=0.0,
        unended_in_trainable=0,
        group_ended=ended or {},
        group_running=running or {},
    )


def ids(items: list[PendingExecution]) -> list[int]:
    return [item.exec_id for item in items]


def test_untouched_tasks_get_a_probe_each_then_go_in_id_order() -> None:
    s = state([(0, 0, 7), (1, 0, 7), (2, 0, 8), (3, 0, 8), (4, 0, 9)])
    assert ids(SiblingOrder(PRIOR).order(s)) == [0, 2, 4, 1, 3]


def test_a_task_whose_siblings_ended_quickly_goes_last_and_one_still_running_goes_first() -> None:
    # task 1: two siblings ended after 5 minutes; task 2: untouched; task 3: two siblings running 1 h
    s = state(
        [(10, 0, 1), (11, 0, 2), (12, 0, 2), (13, 0, 3)],
        ended={1: [EndedExecution(300.0, False), EndedExecution(300.0, False)]},
        running={3: {20: 0.0, 21: 0.0}},
    )
    # the probe of untouched task 2 first, then task 3 (long), task 2's rest, task 1 (short)
    assert ids(SiblingOrder(PRIOR).order(s)) == [11, 13, 12, 10]


def test_a_timed_out_sibling_counts_as_at_least_the_timeout() -> None:
    order = SiblingOrder(PRIOR)
    s = state(
        [(0, 0, 1), (1, 0, 2)],
        ended={1: [EndedExecution(1.4 * HOUR, False)], 2: [EndedExecution(1.5 * HOUR, True)]},
    )
    short, timed_out = order.posterior_means(s, [1, 2])
    assert timed_out > short
    assert ids(order.order(s)) == [1, 0]


def test_posterior_mean_rises_with_what_the_siblings_ran() -> None:
    order = SiblingOrder(PRIOR)
    means = [
        order.posterior_means(state([(0, 0, 1)], ended={1: [EndedExecution(h * HOUR, False)]}), [1])[0]
        for h in (0.05, 0.2, 0.4, 0.8, 1.2)
    ]
    assert means == sorted(means) and means[0] < PRIOR.mu_log_s < means[-1]
    # with no information the posterior is the prior's mean
    assert order.posterior_means(state([(0, 0, 1)]), [1])[0] == pytest.approx(PRIOR.mu_log_s, abs=1e-6)
    # running longer says more: 1 h still running beats 10 minutes still running
    at = [
        order.posterior_means(state([(0, 0, 1)], running={1: {5: 0.0}}, now=now), [1])[0]
        for now in (600.0, HOUR)
    ]
    assert at[0] < at[1]


def test_tasks_with_the_same_history_tie_exactly_whatever_else_is_ranked() -> None:
    # ties must not hang on rounding: tasks 1 and 3 ran the same, so their means are equal floats,
    # the same as when each is ranked alone, and the tie goes to the task id
    ended = {g: [EndedExecution(0.3 * HOUR, False), EndedExecution(0.9 * HOUR, False)] for g in (1, 3)}
    ended[2] = [EndedExecution(1.5 * HOUR, True)]
    running = {g: {10 + g: 0.2 * HOUR} for g in (1, 2, 3)}
    s = state([(0, 0, 3), (1, 0, 2), (2, 0, 1)], ended=ended, running=running)
    order = SiblingOrder(PRIOR)
    together = order.posterior_means(s, [1, 2, 3, 4])
    assert together[0] == together[2] == order.posterior_means(s, [3])[0] == order.posterior_means(s, [1])[0]
    assert together[3] == order.posterior_means(state([(0, 0, 4)]), [4])[0]  # untouched: the prior
    assert ids(order.order(s)) == [1, 2, 0]  # task 2 (timed out) first, then tasks 1 and 3 by id


def test_means_that_differ_only_in_their_last_bits_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    # np.exp and numpy's sums take other SIMD paths on other CPUs: the order must not hang on the last
    # bits (a 2-cell nl2repo run ranked otherwise on an AMD EPYC without AVX-512 than where it was
    # measured). Tasks 2 and 3 have one sibling running each; task 3's mean is 1 ULP above task 2's:
    # a tie, which goes to the id; 1e-3 more is a real difference, and task 3 goes first.
    s = state([(0, 0, 2), (1, 0, 3)], running={2: {8: 0.0}, 3: {9: 0.0}})
    order = SiblingOrder(PRIOR)
    for above, expected in ((np.nextafter(8.0, 9.0), [0, 1]), (8.0 + 1e-3, [1, 0])):
        monkeypatch.setattr(order, "posterior_means", lambda _s, groups, above=above: [8.0, above])
        assert ids(order.order(s)) == expected


def test_a_task_whose_history_grows_is_scored_anew() -> None:
    # the ended executions' likelihood is kept per history: one more end must change the score
    order = SiblingOrder(PRIOR)
    one = {1: [EndedExecution(0.1 * HOUR, False)]}
    two = {1: [EndedExecution(0.1 * HOUR, False), EndedExecution(0.1 * HOUR, False)]}
    first = order.posterior_means(state([(0, 0, 1)], ended=one), [1])[0]
    assert order.posterior_means(state([(0, 0, 1)], ended=two), [1])[0] < first
    assert order.posterior_means(state([(0, 0, 1)], ended=one), [1])[0] == first


def test_batches_stay_oldest_first_and_unlaunchable_ones_are_left_out() -> None:
    s = state(
        [(0, 0, 1), (1, 1, 5), (2, 1, 6), (3, 2, 9)],
        ended={1: [EndedExecution(60.0, False)]},
        running={6: {30: 0.0}},
        eta=1,
    )
    # batch 0 first even though its task looks short; batch 2 is past eta = 1 at version 0
    assert ids(SiblingOrder(PRIOR).order(s)) == [0, 1, 2]


def test_without_task_ids_the_order_is_first_in_first_out() -> None:
    s = state([(0, 0, -1), (1, 0, -1), (2, 0, -1)], running={})
    assert ids(SiblingOrder(PRIOR).order(s)) == [0, 1, 2]


def test_bad_priors_and_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="sigma_log > 0"):
        DurationPrior(0.0, 0.0, 0.5, 10.0)
    with pytest.raises(ValueError, match="0 < rho < 1"):
        DurationPrior(0.0, 1.0, 1.0, 10.0)
    with pytest.raises(ValueError, match="needs duration_prior"):
        make_policy("elastic", launch_order="sibling")
    with pytest.raises(ValueError, match="launch_order must be one of"):
        make_policy("elastic", launch_order="random", duration_prior=PRIOR)


def test_elastic_launches_in_the_sibling_order() -> None:
    s = state(
        [(10, 0, 1), (11, 0, 3)],
        ended={1: [EndedExecution(300.0, False)]},
        running={3: {20: 0.0}},
    )
    s = replace(s, cells=(CellState(0, Role.ROLLOUT, 1.0),))  # room for one
    fifo = make_policy("elastic", prefetch="spare").decide(s)
    sibling = make_policy("elastic", prefetch="spare", launch_order="sibling", duration_prior=PRIOR).decide(s)
    assert [a.exec_id for a in fifo if isinstance(a, Launch)] == [10]
    assert [a.exec_id for a in sibling if isinstance(a, Launch)] == [11]


class _Spy:
    """Wraps a policy and checks, at every decision, the task history and the per-batch in-flight
    demand the simulator shows it."""

    name = "spy"

    def __init__(self, inner, wl) -> None:
        self.inner, self.wl, self.checked = inner, wl, 0
        self.launched_at: dict[int, float] = {}

    def initial_roles(self, n_cells: int) -> list[Role]:
        return self.inner.initial_roles(n_cells)

    def decide(self, s: SchedState) -> list:
        for g, running in s.group_running.items():
            for e, at in running.items():
                assert (
                    self.wl.group[e] == g and s.in_flight[e].group == g and s.in_flight[e].launched_at == at
                )
        for g, ended in s.group_ended.items():
            for item in ended:
                assert item.ran_s >= 0
            assert len(ended) + len(s.group_running[g]) <= int(np.sum(self.wl.group == g))
        # the simulator's per-batch in-flight demand is the sum over what is in flight
        assert s.in_flight_demand_by_batch is not None
        for b in range(s.steps_total):
            fresh = sum(e.demand for e in s.in_flight.values() if e.batch <= b)
            assert s.in_flight_demand(b) == pytest.approx(fresh, abs=1e-9)
        self.checked += 1
        self.last = s
        return self.inner.decide(s)


def test_the_simulator_shows_each_tasks_history_and_timeouts() -> None:
    wl = sample_workload(PRESETS["nl2repo"], 2, seed=3)
    spy = _Spy(make_policy("elastic", prefetch="trickle", launch_order="sibling", duration_prior=PRIOR), wl)
    sim = Simulator(wl, spy, 2, 1, SimCosts(), record=True)
    result = sim.run()
    assert spy.checked > 100 and result.makespan_s > 0
    ended = spy.last.group_ended  # a live view: after the run it holds every end
    assert sum(len(v) for v in ended.values()) == wl.n_executions
    timed_out = sum(item.timed_out for v in ended.values() for item in v)
    assert timed_out == int(wl.timed_out.sum()) > 0
    # what an execution "ran" is its duration plus any pause the simulator added (migration, weight loads)
    for g, items in ended.items():
        runs = sorted(item.ran_s for item in items)
        members = np.flatnonzero(wl.group == g)
        expected = sorted(wl.duration_s[members] + np.asarray(result.timeline.delay_s)[members])
        assert np.allclose(runs, expected, atol=1e-6), g
