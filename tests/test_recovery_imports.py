"""A satellite that dies after exporting its gradients, before the core fetched them (no Ray: the
scheduler's recovery steps driven by hand). The core's import then fails with the transfer's own
error (the object the satellite owned is gone), which is not a cell loss by its type: the run used
to stop there, though the module's promise is that such micro-batches are trained again."""

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
    sched.core, sched.micro, sched.streams, sched.update = 0, {}, {3: stream}, None
    sched.unmerged = [[], []]
    sched.import_of = {IMPORT: (1, [(3, 0), (3, 1)])}  # cell 1's sum of micro-batches 0 and 1 of batch 3
    sched.imports = {IMPORT}
    sched.micro, sched.switches, sched.restarts, sched.syncs, sched.watches, sched.ref_cell = (
        {},
        {},
        {},
        {},
        {},
        {},
    )
    sched.lost: list[tuple[int, str]] = []
    sched._cell_lost = lambda index, why: sched.lost.append((index, why))
    return sched, stream


def test_a_failed_import_from_a_dead_satellite_is_its_loss(monkeypatch) -> None:
    sched, _ = recovery(monkeypatch, satellite_alive=False)
    assert sched._check_loss(IMPORT) and sched.lost == [(1, "TransferError")]


def test_a_failed_import_from_a_live_satellite_still_stops_the_run(monkeypatch) -> None:
    sched, _ = recovery(monkeypatch, satellite_alive=True)
    with pytest.raises(TransferError):
        sched._check_loss(IMPORT)


def test_the_micro_batches_a_dead_satellites_failed_import_carried_are_trained_again(monkeypatch) -> None:
    sched, stream = recovery(monkeypatch, satellite_alive=False)
    assert CellRecovery._requeue_lost_work(sched, 1) == 2
    assert stream.untrained == [0, 1] and not sched.import_of and not sched.imports
