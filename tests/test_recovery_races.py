"""Cell losses and restarts that used to stop or stall the run, or break the staleness bound (no Ray:
the scheduler's recovery, update and launch steps driven by hand, with the fake cells of
tests/test_publish_races.py).

- a cell lost for good (no pool, or `MAX_RESTARTS` used up) stayed "switching to rollout" forever,
  and elastic never switched a cell to training again: the run hung until its timeout;
- a cell dying while a version was being published was sent that version again on its dead handle
  (the publish went on at once from inside the recovery), and that call's failure was taken for a
  second loss: its replacement was killed and two restarts counted;
- a restarted cell undrained on the old version while the new one was being published;
- a restart that failed with an error other than a cell loss stopped the run;
- the core's switch to training raced the optimizer step (the core then refused the switch);
- a scheduler restarted between an execution's register and its journaled launch registered it
  again: "already registered" stopped the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import RayTaskError

from gyre_ray.runtime.recovery import MAX_RESTARTS
from gyre_ray.runtime.scheduler import RunScheduler
from gyre_ray.runtime.stream import MicroBatchStream
from gyre_ray.runtime.work import Switch
from gyre_ray.scheduling.elastic import ElasticPolicy
from gyre_ray.scheduling.runtime import CellPhase, Costs, ExecutionLedger, build_state
from gyre_ray.scheduling.state import Launch, SwitchToTrain
from tests.test_publish_races import Call, FakeCell, finish, publish, scheduler


class NewCell(FakeCell):
    """The actor `CellPool.restart` starts for a lost cell (its calls recorded apart from the old one's)."""

    _actor_id = SimpleNamespace(hex=lambda: "5a" * 16)


class Pool:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.restarted: list[str] = []

    def restart(self, cell_id: str) -> NewCell:
        self.restarted.append(cell_id)
        return NewCell(int(cell_id.split("-")[1]), self.calls)


def recovering(
    phases: list[CellPhase], monkeypatch: pytest.MonkeyPatch, pool: Pool | None
) -> tuple[RunScheduler, list[Call]]:
    """`scheduler` of tests/test_publish_races.py plus the recovery's bookkeeping."""
    sched, calls = scheduler(phases, monkeypatch)
    sched.ids = [v.cell_id for v in sched.views]
    sched.pool, sched.restart_count, sched.faults = pool, {}, []
    sched.watches, sched.restarts, sched.syncs, sched.micro = {}, {}, {}, {}
    sched.unmerged = [[] for _ in phases]
    sched.import_of = {}
    sched.has_grads = [False] * len(phases)
    sched.ledger = ExecutionLedger.planned([])
    sched.journal.fault = lambda event: None
    return sched, calls


def test_a_cell_lost_for_good_leaves_the_policy_free_to_switch_the_others(monkeypatch) -> None:
    """Before: the lost cell stayed TO_ROLLOUT, a rollout cell "not ready", and elastic's water level
    never sent a cell to training again (nor could the core train the queued micro-batches)."""
    sched, calls = recovering([CellPhase.ROLLOUT] * 3, monkeypatch, pool=None)
    sched.update, sched.updates = None, 0
    sched.ledger = ExecutionLedger.planned([0])
    sched.ledger.launch(0, 1, 0.0)  # the step's last execution still running, on cell 1
    sched._cell_lost(2, "ActorDiedError")
    state = build_state(10.0, 0, 3, 0, sched.views, sched.ledger, 4, Costs())
    assert SwitchToTrain(0) in ElasticPolicy().decide(state), "the core trains the 4 queued micro-batches"
    assert [c.cell_id for c in state.cells] == [0, 1]  # left out: no capacity, nothing to wait for
    assert sched.views[2].phase is CellPhase.LOST and sched.faults[-1]["restarted"] is False
    assert not [c for c in calls if c.cell == 2], "nothing is sent to the dead cell"


def test_a_cell_past_its_restarts_is_lost_for_good_and_never_watched_again(monkeypatch) -> None:
    pool = Pool()
    sched, calls = recovering([CellPhase.ROLLOUT] * 3, monkeypatch, pool=pool)
    sched.restart_count[2] = MAX_RESTARTS
    sched._cell_lost(2, "ActorDiedError")
    assert sched.views[2].phase is CellPhase.LOST and not pool.restarted and not sched.restarts
    for actor in sched.actors:
        actor._actor_id = SimpleNamespace(hex=lambda: "00" * 16)
    sched._watch_cells()  # (the next run on the same cells)
    assert {index for index, _ in sched.watches.values()} == {0, 1}


def test_a_cell_dying_during_the_publish_is_lost_once(monkeypatch) -> None:
    """Before: the recovery completed the publish's stage from inside `_cell_lost` while the dead cell
    still looked like a serving cell, so the version was sent again to its dead actor; that call's
    failure then counted as a second loss (the fresh replacement killed, two restarts)."""
    pool = Pool()
    sched, calls = recovering([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.ROLLOUT], monkeypatch, pool)
    sent = publish(sched)
    assert set(sent) == {Call(1, "update_weights", 2), Call(2, "update_weights", 2)}
    finish(sched, Call(2, "update_weights", 2))
    before = len(calls)
    sched._cell_lost(1, "ActorDiedError")  # its load of version 2 failed: the cell died
    assert calls[before:] == [], "nothing more is sent to the dead actor"
    assert sched.update is None and sched.trainer_version == 2  # published on the cells that hold it
    assert pool.restarted == ["cell-1"] and sched.restart_count == {1: 1}
    assert [c.method for c in pool.calls] == ["watch", "rejoin"] and pool.calls[-1].version == 2


def test_a_restart_whose_rejoin_fails_otherwise_is_restarted_again(monkeypatch) -> None:
    """Before: `_check_loss` re-raised any error that is not a cell loss, also for the restarted
    actor's own rejoin (an out-of-memory while building its engine): the run stopped."""
    pool = Pool()
    sched, _ = recovering([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_ROLLOUT], monkeypatch, pool)
    sched.update = None
    rejoin = Call(2, "rejoin", 0)  # begun at version 0
    sched.restarts[rejoin] = Switch(2, "restart", 0.0, 0, event={"cell": "cell-2"})
    sched.restart_count[2] = 1
    oom = RayTaskError("rejoin", "Traceback ...", RuntimeError("CUDA out of memory"))
    monkeypatch.setattr(ray, "get", lambda ref, **_: _raise(oom) if ref == rejoin else ref.result)
    assert sched._check_loss(rejoin)
    assert pool.restarted == ["cell-2"] and sched.restart_count[2] == 2
    assert [s.cell for s in sched.restarts.values()] == [2] and rejoin not in sched.restarts
    # one failure too many: the run goes on without the cell
    (again,) = sched.restarts
    sched.restart_count[2] = MAX_RESTARTS
    monkeypatch.setattr(ray, "get", lambda ref, **_: _raise(oom))
    assert sched._check_loss(again)
    assert sched.views[2].phase is CellPhase.LOST and not sched.restarts and pool.restarted == ["cell-2"]


def test_a_rejoin_returning_during_the_publish_loads_the_new_version_before_the_cell_serves(
    monkeypatch,
) -> None:
    """Before: the rejoin's follow-up compared against the version still published and undrained
    the cell on it (`load_and_undrain(None, 1)`), while the publish, which had skipped the cell (it
    was restarting), completed at version 2: with eta = 0 the cell served version 1 to step 2."""
    sched, calls = recovering(
        [CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_ROLLOUT], monkeypatch, None
    )
    rejoin = Call(2, "rejoin", 1, {"version": 1})
    sched.restarts[rejoin] = Switch(2, "restart", 0.0, 1, event={"cell": "cell-2"})
    (to_cell_1,) = publish(sched)
    sched._rejoin_done(rejoin)  # its engine holds version 1; version 2 is being published
    assert calls[-1] == Call(2, "update_weights", 2), "it loads the version in publish, still drained"
    sched._rejoin_done(calls[-1])
    assert calls[-1] == Call(2, "undrain", None)
    finish(sched, to_cell_1)
    assert sched.update is None and sched.trainer_version == 2
    sched._rejoin_done(calls[-1])
    assert sched.views[2].phase is CellPhase.ROLLOUT and sched.engine_version == [1, 2, 2]
    assert not sched.restarts and not sched.syncs
    assert [c.method for c in calls if c.cell == 2] == ["update_weights", "undrain"]


def test_a_publish_beginning_as_a_restarted_cell_undrains_waits_for_it(monkeypatch) -> None:
    """Before: a publish that began while the restarted cell's undrain was under way skipped it and
    completed at version 2 with the cell undrained on version 1."""
    sched, calls = recovering(
        [CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_ROLLOUT], monkeypatch, None
    )
    rejoin = Call(2, "rejoin", 1, {"version": 1})
    sched.restarts[rejoin] = Switch(2, "restart", 0.0, 1, event={"cell": "cell-2"})
    sched._rejoin_done(rejoin)  # holds version 1, the published one: undrains (optimizer step under way)
    undrain = next(iter(sched.restarts))
    sent = publish(sched)
    assert set(sent) == {Call(1, "update_weights", 2), Call(2, "update_weights", 2)}
    sched._rejoin_done(undrain)  # serving, the publish still waiting for it
    finish(sched, Call(1, "update_weights", 2))
    assert sched.update is not None and sched.trainer_version == 1
    finish(sched, Call(2, "update_weights", 2))
    assert sched.update is None and sched.trainer_version == 2 and sched.engine_version == [1, 2, 2]
    assert not sched.syncs


def test_a_restart_begun_during_the_publish_rejoins_on_the_version_in_publish(monkeypatch) -> None:
    pool = Pool()
    sched, _ = recovering([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.ROLLOUT], monkeypatch, pool)
    publish(sched)
    sched._cell_lost(2, "ActorDiedError")
    assert sched.update is not None and pool.calls[-1] == Call(2, "rejoin", 2)


def test_the_update_waits_for_the_cores_switch_to_training(monkeypatch) -> None:
    """Before: the step's last micro-batch trained on a satellite while the core was still switching
    to training; the update began, the optimizer step made the core version 2, and the core's switch
    (asked for version 1) then failed: "core cell-0 holds version 2, asked for 1"."""
    sched, calls = recovering([CellPhase.TO_TRAIN, CellPhase.TRAIN_IDLE], monkeypatch, None)
    sched.update = None
    stream = sched.streams[1] = MicroBatchStream()
    stream.put("batch-1-ref", ["e"])
    stream.seal()
    item = stream.claim("cell-1")
    stream.trained(item.index, "cell-1")
    going = Switch(0, "to_train", 0.0, 1)
    switching = Call(0, "switch_to_training", 1, {"version": 1, "migrated": 0})
    sched.switches[switching] = going
    sched._maybe_update()
    assert sched.update is None and not [c for c in calls if c.method == "optimizer_step"]
    sched._switch_done(switching, sched.switches.pop(switching))
    sched._maybe_update()
    assert sched.update is not None and calls[-1].method == "optimizer_step"


@dataclass(frozen=True)
class Planned:
    execution_id: str
    group: str
    task: Any


def test_an_execution_registered_by_a_dead_scheduler_is_launched_under_a_new_id(monkeypatch) -> None:
    """Before: `_launch` registered the execution's id again, and the store's "already registered"
    stopped the run."""
    registered = {"s0-t0-0": "old-key"}
    finished: list[str] = []

    def register(execution_id: str, metadata: dict[str, Any]) -> Any:
        def answer() -> dict[str, str]:
            if execution_id in registered:
                error = f"execution {execution_id!r} is already registered"
                raise RayTaskError("register", f"Traceback ...\nStoreError: {error}", RuntimeError(error))
            registered[execution_id] = f"key-{execution_id}"
            return {"execution_id": execution_id, "api_key": registered[execution_id]}

        return answer

    def get(ref: Any, **_: Any) -> Any:
        return [r() for r in ref] if isinstance(ref, list) else ref()

    monkeypatch.setattr(ray, "get", get)
    sched = RunScheduler.__new__(RunScheduler)
    sched.store = SimpleNamespace(
        register=SimpleNamespace(remote=register),
        finish_execution=SimpleNamespace(remote=finished.append),
    )
    task = SimpleNamespace(task_id="t0")
    sched.planned = [Planned("s0-t0-0", "s0-t0", task), Planned("s0-t0-1", "s0-t0", task)]
    sched.ledger = ExecutionLedger.planned([0, 0])
    sched.running, sched.runners, sched.lost_runners = {}, [], set()
    sched.trainer_version, sched.t0 = 0, 0.0
    started: list[tuple[str, str]] = []

    def start(item: Planned, key: str, runner: int | None) -> tuple[str, None]:
        started.append((item.execution_id, key))
        return item.execution_id, None  # the outcome's "ref"

    sched._start_execution = start
    journaled: list[str] = []
    sched.journal = SimpleNamespace(launched=lambda *a, execution_id, **k: journaled.append(execution_id))
    sched.recorder = SimpleNamespace(launched=lambda *a: None, ran_on=lambda *a: None, loads=lambda *a: None)
    sched._launch([Launch(0, 0), Launch(1, 0)])
    assert started == [("r1.s0-t0-0", "key-r1.s0-t0-0"), ("s0-t0-1", "key-s0-t0-1")]
    assert finished == ["s0-t0-0"], "the spent id's key is revoked (a harness it started adds nothing)"
    assert journaled == ["r1.s0-t0-0", "s0-t0-1"] and sched.planned[0].execution_id == "r1.s0-t0-0"
    assert sorted(sched.ledger.hosted) == [0, 1]


def _raise(exc: BaseException) -> None:
    raise exc


def test_a_restarted_scheduler_finding_a_cell_dead_without_a_pool_loses_it_once(monkeypatch) -> None:
    """Before: the reset of the cells read every cell until `SETTLE_READS` reads agreed, and each read
    found the dead cell (not restarted: no pool) dead again, a new fault each time."""
    import time

    from ray.exceptions import ActorDiedError

    sched, _ = recovering([CellPhase.ROLLOUT] * 3, monkeypatch, pool=None)
    sched.update = None
    status = {"role": "rollout", "draining": False, "unexported_micro_batches": 0, "engine": {"version": 1}}

    def get(ref: Any, **_: Any) -> Any:
        if ref == Call(1, "status", None):
            raise ActorDiedError()
        return status if ref.method == "status" else False

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    sched._reset_cells()
    assert [f["cell"] for f in sched.faults] == ["cell-1"] and sched.views[1].phase is CellPhase.LOST


def test_a_launch_the_policy_placed_on_a_cell_it_then_switches_moves_with_the_switch(monkeypatch) -> None:
    """Elastic may place a launch on a cell and switch that cell to training in one decision (counting
    on the switch to move it). `_decide` switched first and launched after, so the execution was
    booked on a cell in `to_train`: queued demand for its whole life, and its real cell looked empty."""
    from gyre_ray.scheduling.runtime import migrate_executions

    sched, _ = recovering([CellPhase.ROLLOUT] * 2, monkeypatch, pool=None)
    sched.update, sched.updates, sched.eta = None, 0, 0
    sched.ledger = ExecutionLedger.planned([0])
    sched.live.waiting_calls = {}
    sched.runners, sched.lost_runners = [], set()
    sched.policy = SimpleNamespace(decide=lambda state: [Launch(0, 0), SwitchToTrain(0)])
    order: list[str] = []

    def launch(launches: list[Launch]) -> None:
        order.append("launch")
        for a in launches:
            sched.ledger.launch(a.exec_id, a.cell_id, 0.0)

    def switch(index: int) -> None:
        order.append("switch")
        migrate_executions(sched.ledger, index, sched.views)
        sched.views[index].enter(CellPhase.TO_TRAIN, 0.0)

    sched._launch, sched._switch_to_train = launch, switch
    sched._decide()
    assert order == ["launch", "switch"]
    assert sched.ledger.hosted == {0: 1}, "the execution moves to the cell that stays in rollout"
