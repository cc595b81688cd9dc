"""Satellites lost where the run used to stop (no Ray: the scheduler's recovery steps driven by hand).

One that dies after exporting its gradients, before the core fetched them: the core's import then
fails with the transfer's own error (the object the satellite owned is gone), which is not a cell
loss by its type, though the recovery module's promise is that such micro-batches are trained
again. And one that dies on its way back to rollout after the last step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import ActorDiedError

from gyre_ray.runtime.recovery import CellRecovery
from gyre_ray.transfer.base import TransferError

IMPORT, PROBE = "import-ref", "probe-ref"


class Stream:
    def __init__(self) -> None:
        self.untrained: list[int] = []

    def untrain(self, item: int) -> None:
        self.untrained.append(item)


def recovery(monkeypatch: pytest.MonkeyPatch, satellite_alive: bool) -> tuple[CellRecovery, Stream]:
    failures: dict[str, BaseException] = {
        IMPORT: TransferError("object_store: fetch of gradients v3 from cell-1 failed: OwnerDiedError"),
    }
    if not satellite_alive:
        failures[PROBE] = ActorDiedError()

    def get(ref: Any, **_: Any) -> Any:
        if ref in failures:
            raise failures[ref]
        return False

    monkeypatch.setattr(ray, "get", get)
    sched = CellRecovery()
    stream = Stream()
    sched.actors = [None, SimpleNamespace(is_draining=SimpleNamespace(remote=lambda: PROBE))]
    sched.core, sched.streams, sched.update = 0, {3: stream}, None
    sched.unmerged = [[], []]
    sched.import_of = {IMPORT: (1, [(3, 0), (3, 1)])}  # cell 1's sum of micro-batches 0 and 1 of batch 3
    sched.imports = {IMPORT}
    sched.micro = {}
    sched.switches = {}
    sched.restarts = {}
    sched.syncs = {}
    sched.watches = {}
    sched.ref_cell = {}
    sched.lost: list[tuple[int, str]] = []
    sched._cell_lost = lambda index, why: sched.lost.append((index, why))
    return sched, stream


def test_a_failed_import_from_a_dead_satellite_is_its_loss(monkeypatch) -> None:
    sched, _ = recovery(monkeypatch, satellite_alive=False)
    assert sched._check_loss(IMPORT) and sched.lost == [(1, "TransferError")]


def test_the_core_dying_under_its_import_is_the_cores_loss_not_the_satellites(monkeypatch) -> None:
    """The import runs on the core: when the core dies under it, the error names the core's actor
    (checked on Ray 2.60: ActorDiedError with the core's id), and the loss is the core's (the run
    restarts from a checkpoint), not a restart of the live satellite the import was fetching from."""
    sched, _ = recovery(monkeypatch, satellite_alive=True)
    died = ActorDiedError()
    died.actor_id = "c0" * 16
    sched.actors[0] = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "c0" * 16))
    monkeypatch.setattr(ray, "get", lambda ref, **_: _raise(died) if ref == IMPORT else False)
    assert sched._check_loss(IMPORT) and sched.lost == [(0, "ActorDiedError")]
    died.actor_id = "5a" * 16  # the satellite's (a task error whose cause is its death): its loss
    assert sched._check_loss(IMPORT) and sched.lost[-1] == (1, "ActorDiedError")


def _raise(exc: BaseException) -> None:
    raise exc


def test_a_failed_import_from_a_live_satellite_still_stops_the_run(monkeypatch) -> None:
    sched, _ = recovery(monkeypatch, satellite_alive=True)
    with pytest.raises(TransferError):
        sched._check_loss(IMPORT)


def test_the_micro_batches_a_dead_satellites_failed_import_carried_are_trained_again(monkeypatch) -> None:
    sched, stream = recovery(monkeypatch, satellite_alive=False)
    assert CellRecovery._requeue_lost_work(sched, 1) == 2
    assert stream.untrained == [0, 1] and not sched.import_of and not sched.imports


def test_a_satellite_lost_while_the_cells_settle_after_the_last_step_costs_no_result(monkeypatch) -> None:
    """Every step was done when a training satellite died on its way back to rollout: `run` raised
    and the run's result was lost. Now the cell is recovered as any lost cell and the run returns."""
    from gyre_ray.runtime.scheduler import RunScheduler
    from gyre_ray.scheduling.runtime import CellPhase, CellView

    calls: list[str] = []

    def cell(name: str) -> SimpleNamespace:
        return SimpleNamespace(switch_to_rollout=SimpleNamespace(remote=lambda *a: name))

    def get(ref: Any, **_: Any) -> Any:
        if ref == "sat":
            raise ActorDiedError()
        return {}

    monkeypatch.setattr(ray, "get", get)
    sched = RunScheduler.__new__(RunScheduler)
    sched.views = [CellView("cell-0", 0, phase=CellPhase.TRAIN_IDLE, is_core=True),
                   CellView("cell-1", 1, phase=CellPhase.TRAIN_IDLE)]  # fmt: skip
    sched.actors = [cell("core"), cell("sat")]
    sched.core, sched.weights, sched.trainer_version, sched.t0 = 0, "w", 3, 0.0
    sched.switches, sched.syncs, sched.imports, sched.restarts = {}, {}, set(), {}
    sched._settle_restarts = lambda: calls.append("settle restarts")
    sched._cell_lost = lambda index, why: calls.append(f"lost {index}: {why}")
    sched._settle()
    assert calls == ["settle restarts", "lost 1: ActorDiedError (after the last step)", "settle restarts"]
