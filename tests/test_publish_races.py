"""A cell whose role switch ends while an update is being published must hold the new version before
the version counts as published (no Ray: the scheduler's update and switch stages driven by hand).

Before the fix, the publish sent the version only to the cells serving or idle-training when it
began; a cell coming back from training during it undrained on the old version (its catch-up compared
against the version still published), and the published stage then booked it as holding the new
one: with eta = 0 it served version v through step v + 1. A satellite whose switch to training ended
during the publish trained the next batch on the old weights the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from gyre_ray.runtime.scheduler import RunScheduler
from gyre_ray.runtime.work import Switch, Update
from gyre_ray.scheduling.runtime import CellPhase, CellView, Costs


@dataclass(frozen=True)
class Call:
    """A stand-in for the ref of one actor call: which cell, what, with which version."""

    cell: int
    method: str
    version: int | None
    result: Any = field(default=None, compare=False)


class FakeCell:
    """Each method's `.remote(...)` returns a `Call` (recorded), never run."""

    def __init__(self, index: int, calls: list[Call]) -> None:
        self.index, self.calls = index, calls

    def __getattr__(self, method: str) -> Any:
        def remote(*args: Any) -> Call:
            version = args[1] if len(args) > 1 else None
            result = {"version": version, "engine": {"version": version}}
            call = Call(self.index, method, version, result)
            self.calls.append(call)
            return call

        return SimpleNamespace(remote=remote)


def scheduler(phases: list[CellPhase], monkeypatch: pytest.MonkeyPatch) -> tuple[RunScheduler, list[Call]]:
    """Cell 0 the core; the others satellites; version 1 published, update of batch 1 at its step."""
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref.result)
    calls: list[Call] = []
    sched = RunScheduler.__new__(RunScheduler)
    sched.views = [CellView(f"cell-{i}", i, phase=p, is_core=i == 0) for i, p in enumerate(phases)]
    sched.actors = [FakeCell(i, calls) for i in range(len(phases))]
    sched.core = 0
    sched.trainer_version, sched.weights = 1, "weights-v1"
    sched.engine_version = [1] * len(phases)
    sched.sat_version = [1] * len(phases)
    sched.switches, sched.ref_cell, sched.imports, sched.restarts = {}, {}, set(), {}
    sched.costs = Costs()
    sched.updates, sched.steps, sched.checkpoint_every = 1, 3, 0
    sched.step_metrics = []
    sched.streams = {}
    sched.cfg = SimpleNamespace(scheduler=SimpleNamespace(fits_duration_prior=False))
    sched.recorder = SimpleNamespace(
        phase=lambda index, view, phase, now: view.enter(phase, now), switched=lambda *a: None, drains=[],
        loads=lambda *a: None, mean_switch=lambda direction: 1.0, step_done=lambda *a: {"step": 1},
    )  # fmt: skip
    sched.live = SimpleNamespace(
        switched=lambda *a: None, step_done=lambda *a: None, poll_engines=lambda *a: None
    )
    sched.journal = SimpleNamespace(published=lambda *a: None)
    sched.t0 = 0.0
    sched._merged = lambda ref: None
    sched.update = Update(1, "step", 0.0, metrics={"version": 2})
    return sched, calls


def publish(sched: RunScheduler) -> list[Call]:
    """Enter the publish stage (the optimizer step returned version 2); the calls it sent."""
    sched.update.refs.clear()
    sched._next_stage()
    assert sched.update.stage == "publish"
    return [r for r in sched.update.refs]


def finish(sched: RunScheduler, ref: Call) -> None:
    """One publish call returns."""
    sched._update_progress(ref)


def test_a_cell_returning_during_the_publish_loads_the_new_version_before_it_serves(monkeypatch) -> None:
    # cell 1 serves (it is sent version 2); cell 2 is on its way back to rollout (stage 1 in flight)
    sched, calls = scheduler([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_ROLLOUT], monkeypatch)
    back = Switch(2, "to_rollout", 0.0, 1)
    (to_cell_1,) = publish(sched)
    assert to_cell_1 == Call(1, "update_weights", 2)
    # cell 2's engine came back holding version 1 while version 2 is being published
    sched._switch_done(Call(2, "to_rollout", 1, {"version": 1}), back)
    assert calls[-1] == Call(2, "update_weights", 2), "it must load the version in publish, not undrain on v1"
    assert back.stage == 2
    sched._switch_done(calls[-1], back)  # loaded: now it may serve
    assert calls[-1] == Call(2, "undrain", None) and back.stage == 3
    finish(sched, to_cell_1)
    assert sched.update is None and sched.trainer_version == 2
    sched._switch_done(calls[-1], back)
    assert sched.views[2].phase is CellPhase.ROLLOUT and sched.engine_version == [1, 2, 2]
    assert [c for c in calls if c.method == "undrain"] == [Call(2, "undrain", None)]


def test_a_cell_undraining_as_the_publish_begins_is_sent_the_version(monkeypatch) -> None:
    sched, calls = scheduler([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_ROLLOUT], monkeypatch)
    back = Switch(2, "to_rollout", 0.0, 1, stage=3)  # caught up on version 1, its undrain in flight
    sched.switches[Call(2, "undrain", None)] = back
    sent = publish(sched)
    assert set(sent) == {Call(1, "update_weights", 2), Call(2, "update_weights", 2)}
    sched._switch_done(Call(2, "undrain", None), back)  # serving, the publish still under way
    for ref in sent:
        finish(sched, ref)
    assert sched.trainer_version == 2 and sched.engine_version == [1, 2, 2]


def test_a_satellite_that_became_a_trainer_during_the_publish_holds_the_version_before_it_counts(
    monkeypatch,
) -> None:
    sched, calls = scheduler([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_TRAIN], monkeypatch)
    going = Switch(2, "to_train", 0.0, 1)
    (to_cell_1,) = publish(sched)
    # cell 2's trainer came up with version 1 (published when its switch began)
    sched._switch_done(Call(2, "switch_to_training", 1, {"version": 1, "migrated": 0}), going)
    assert sched.views[2].phase is CellPhase.TRAIN_IDLE and sched.sat_version[2] == 1
    finish(sched, to_cell_1)
    assert sched.update is not None and sched.trainer_version == 1, "not published while cell 2 holds v1"
    assert calls[-1] == Call(2, "load_trainer_weights", 2)
    finish(sched, calls[-1])
    assert sched.update is None and sched.trainer_version == 2 and sched.sat_version[2] == 2


def test_a_satellite_loading_an_older_version_loads_again(monkeypatch) -> None:
    sched, calls = scheduler([CellPhase.TRAIN_IDLE, CellPhase.ROLLOUT, CellPhase.TO_TRAIN], monkeypatch)
    going = Switch(2, "to_train", 0.0, 1, stage=2)  # loading version 1 when version 2 is published
    sched.update = None
    sched.trainer_version, sched.weights = 2, "weights-v2"
    sched._switch_done(Call(2, "load_trainer_weights", 1), going)
    assert calls[-1] == Call(2, "load_trainer_weights", 2) and sched.sat_version[2] == 1
    sched._switch_done(calls[-1], going)
    assert sched.sat_version[2] == 2 and sched.views[2].phase is CellPhase.TRAIN_IDLE


def test_a_published_steps_micro_batches_leave_the_object_store_two_steps_later(monkeypatch) -> None:
    """Every step's micro-batches stayed referenced (in Ray's object store) for the whole run."""
    from gyre_ray.runtime.stream import MicroBatchStream

    sched, _ = scheduler([CellPhase.TRAIN_IDLE, CellPhase.TRAIN_IDLE], monkeypatch)
    sched.update = Update(2, "step", 0.0, metrics={"version": 2})
    for batch in (0, 1, 2):
        sched.streams[batch] = MicroBatchStream()
        sched.streams[batch].put(f"batch-{batch}-ref", ["e"])
    for ref in publish(sched):  # the satellite loads version 2
        finish(sched, ref)
    assert sched.update is None and sched.trainer_version == 2
    assert [item.ref for item in sched.streams[0].items] == [None] and sched.streams[0].released
    assert [item.ref for b in (1, 2) for item in sched.streams[b].items] == ["batch-1-ref", "batch-2-ref"]
