"""What the scheduler does when a cell (not the core) dies: nothing trained is lost, the cell comes back.

`CellRecovery` is a part of `RunScheduler` (a mixin over its state). Each cell has one `watch()` call
pending at all times; it never returns, so it fails the moment the cell's actor dies (`ray.kill`, a
crash, a lost node), as does any other call in flight to that cell. Then `_cell_lost`:

- micro-steps in flight there go back first in line on the step's queue (`give_back`), and so do
  micro-batches the satellite had trained whose gradients never reached the core: not yet exported,
  or exported but the core's `import_grads` failed (the gradients lived in the dead process). A
  pending import is waited for first: one that lands counts, so nothing is trained twice. If the
  update had begun gathering gradients, it is called off (the step is no longer complete) and runs
  again once those micro-batches are trained elsewhere;
- the executions booked on the cell are re-booked on the other rollout cells (their harnesses keep
  running; the proxy already retries their calls on other cells from the recorded tokens);
- calls to the cell that were part of a switch, a weight load or the publish stage are dropped;
- the cell is out of every stage before its work is requeued (a publish that the requeue completes
  sends nothing to the dead actor: that call's failure would count as a second loss);
- the cell is restarted (`CellPool.restart`: a new actor under the same name in the same placement
  group bundle, started drained), rebuilds engine and trainer and loads the current weights
  (`rejoin`), then, still drained, catches up to a version published meanwhile, or being published
  (as a cell coming back from training does), and is undrained; a publish that begins during that
  undrain sends it the new version and waits for it. Until then the policy sees it switching to
  rollout (not ready: no launches, no switches). A restart that fails (its actor dies again, or its
  rejoin raises, say out of memory) counts as another loss of the cell.

Without a pool, or after `MAX_RESTARTS` failed restarts, the run goes on with fewer cells: the cell
is `CellPhase.LOST`, which the policy never sees (no capacity, nothing to wait for). The core
cannot be replaced this way: its death ends the scheduler's run with `CoreLostError`, and the driver
(`gyre_ray.core_restart`) restarts the run from its newest checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from gyre_ray.runtime.work import Switch
from gyre_ray.scheduling.runtime import CellPhase, migrate_executions

MAX_RESTARTS = 3  # restarts of one cell in a run before the run goes on without it
IMPORT_WAIT_S = 300.0  # how long a lost satellite's pending gradient import may still take
REJOIN_SETTLE_S = 120.0  # how long the end of a run waits for cells still restarting


class CoreLostError(RuntimeError):
    """The core cell died: the run cannot go on in this runtime (the driver restarts it from a checkpoint)."""


def is_cell_loss(exc: BaseException) -> bool:
    """True when `exc` says a cell's process is gone (its actor died or an object it owned is lost)."""
    if isinstance(exc, (RayActorError, ObjectLostError)):
        return True
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, (RayActorError, ObjectLostError))


class CellRecovery:
    """Watches the cells and recovers from the loss of one (see the module docstring)."""

    def _init_recovery(self, pool: Any) -> None:
        self.pool = pool
        self.watches: dict[Any, tuple[int, str]] = {}  # watch ref -> (cell, actor id)
        self.restarts: dict[Any, Switch] = {}  # rejoin / catch-up of a restarted cell
        self.restart_count: dict[int, int] = {}
        self.faults: list[dict[str, Any]] = []

    def _reset_recovery(self, cells: int) -> None:
        """Per-run bookkeeping of where trained-but-unmerged gradients are."""
        self.unmerged: list[list[tuple[int, int]]] = [[] for _ in range(cells)]  # (batch, item)
        self.import_of: dict[Any, tuple[int, list[tuple[int, int]]]] = {}  # import ref -> (cell, items)
        self.ref_cell: dict[Any, int] = {}  # update / publish calls to one cell
        self._watch_cells()

    def _watch_cells(self) -> None:
        watched = {index for index, _ in self.watches.values()}
        for index, actor in enumerate(self.actors):
            if index not in watched and not self._restarting(index) and not self.views[index].lost:
                self.watches[actor.watch.remote()] = (index, actor._actor_id.hex())

    def _restarting(self, index: int) -> bool:
        return any(s.cell == index for s in self.restarts.values())

    def _export(self, index: int) -> Any:
        """The core's import of satellite `index`'s gradient sum; remembers which micro-batches it carries."""
        ref = self.actors[self.core].import_grads.remote(self.actors[index].export_grads.remote())
        self.import_of[ref] = (index, self.unmerged[index])
        self.unmerged[index] = []
        return ref

    def _merged(self, ref: Any) -> None:
        self.import_of.pop(ref, None)

    def _cell_of(self, ref: Any) -> int | None:
        """The cell a pending ref is a call to (for an import: the satellite that exported)."""
        if ref in self.micro:
            return self.micro[ref].cell
        if ref in self.switches:
            return self.switches[ref].cell
        if ref in self.restarts:
            return self.restarts[ref].cell
        if ref in self.syncs:
            return self.syncs[ref]
        if ref in self.import_of:
            return self.import_of[ref][0]
        if ref in self.watches:
            return self.watches[ref][0]
        return self.ref_cell.get(ref)

    def _check_loss(self, ref: Any) -> bool:
        """If `ref` (ready) failed because its cell died, recover from that loss; True when it did."""
        index = self._cell_of(ref)
        if index is None:
            return False
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:
            why = type(exc).__name__
            if ref in self.restarts and not is_cell_loss(exc):
                # the restarted actor's rejoin or catch-up failed (an out-of-memory building its
                # engine, say): a failed restart, restarted again up to MAX_RESTARTS
                why = f"{why} (its restart failed)"
            # an import fails with the transfer's own error when the satellite that exported the
            # gradients died before the core fetched them (the object it owned is gone)
            elif not is_cell_loss(exc) and not (ref in self.import_of and self._gone(index)):
                raise
            self._cell_lost(self._dead_cell(exc, index), why)
            return True
        return False

    def _dead_cell(self, exc: BaseException, index: int) -> int:
        """The cell whose actor `exc` says died: the one its actor id names where that is a cell's (the
        core dying under its import of satellite `index`'s gradients is the core's loss, not the
        satellite's), else `index`, the cell the failed call belongs to."""
        actor_id = getattr(exc, "actor_id", None)
        for cell, actor in enumerate(self.actors):
            handle_id = getattr(actor, "_actor_id", None)
            if actor_id and handle_id is not None and handle_id.hex() == actor_id:
                return cell
        return index

    def _gone(self, index: int) -> bool:
        """Whether cell `index`'s actor is dead (asked once, when one of its calls failed oddly)."""
        try:
            ray.get(self.actors[index].is_draining.remote(), timeout=30)
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - slow or busy is not dead
            pass
        return False

    def _cell_lost(self, index: int, why: str) -> None:
        if index == self.core:
            raise CoreLostError(
                f"the core cell {self.ids[index]} died ({why}); restart the run from its last checkpoint"
            )
        now = self._now()
        view = self.views[index]
        for ref in [r for r, (i, _) in self.watches.items() if i == index]:
            del self.watches[ref]
        retry = None
        for ref in [r for r, s in self.restarts.items() if s.cell == index]:
            retry = self.restarts.pop(ref)  # it died again while rejoining
        for ref in [r for r, s in self.switches.items() if s.cell == index]:
            del self.switches[ref]
        for ref in [r for r, i in self.syncs.items() if i == index]:
            del self.syncs[ref]
        self.has_grads[index] = False
        view.return_requested = False
        # out of every stage before the requeue: a publish it completes (`_next_stage`) then sends
        # nothing to the dead actor, whose failure would count as a second loss of the cell
        restartable = self._can_restart(index)
        self.recorder.phase(index, view, CellPhase.TO_ROLLOUT if restartable else CellPhase.LOST, now)
        requeued = self._requeue_lost_work(index)
        # (a cell that died rejoining hosts nothing, unless nothing could take its executions then)
        rehost = retry is None or not restartable
        rehosted = migrate_executions(self.ledger, index, self.views) if rehost else {}
        self.recorder.loads(self, now)
        event = {"cell": view.cell_id, "at_s": round(now, 3), "lost": why, "micro_batches_requeued": requeued,
                 "executions_rehosted": len(rehosted), "batch": self.updates}  # fmt: skip
        self.faults.append(event)
        self.journal.fault(event)
        self._restart(index, event)

    def _requeue_lost_work(self, index: int) -> int:
        """Micro-batches whose gradients died with cell `index` go back on their queue; returns how many."""
        lost = [(step.batch, step.item, ref) for ref, step in self.micro.items() if step.cell == index]
        for batch, item, ref in lost:
            del self.micro[ref]
            self.streams[batch].give_back(item)
        items = list(self.unmerged[index])
        self.unmerged[index] = []
        for ref, (cell, carried) in list(self.import_of.items()):
            if cell != index:
                continue
            try:
                ray.get(ref, timeout=IMPORT_WAIT_S)
                continue  # it reached the core: counted once, handled as a normal completion
            except GetTimeoutError:
                raise  # it may still land: requeued, its micro-batches would be trained twice
            except Exception:  # noqa: BLE001 - the exporter is dead: a failed import added nothing
                pass
            items += carried
            del self.import_of[ref]
            self.imports.discard(ref)
            if self.update is not None:
                self.update.refs.discard(ref)
        for batch, item in items:
            self.streams[batch].untrain(item)
        update = self.update
        if update is not None:
            for ref in [r for r, i in self.ref_cell.items() if i == index]:
                update.refs.discard(ref)
                del self.ref_cell[ref]
            if items and update.stage == "grads":  # the step is incomplete again: gather later
                self.imports |= update.refs
                self.update = None
            elif not update.refs:
                self._next_stage()
        return len(lost) + len(items)

    def _can_restart(self, index: int) -> bool:
        return self.pool is not None and self.restart_count.get(index, 0) < MAX_RESTARTS

    def _restart(self, index: int, event: dict[str, Any]) -> None:
        if not self._can_restart(index):
            event["restarted"] = False  # the run goes on with fewer cells (the cell is LOST)
            return
        self.restart_count[index] = self.restart_count.get(index, 0) + 1
        actor = self.pool.restart(self.ids[index])
        self.actors[index] = actor
        self.watches[actor.watch.remote()] = (index, actor._actor_id.hex())
        weights, version = self._serving_version()  # (the one being published, during a publish)
        ref = actor.rejoin.remote(weights, version)
        self.restarts[ref] = Switch(index, "restart", self._now(), version, event=event)
        event["restarted"] = True

    def _rejoin_done(self, ref: Any) -> None:
        """A stage of a restart returned: the rejoin (stage 1: engine and trainer built, `version`
        loaded, still drained) or a catch-up load (stage 2) go on to `_rejoin_catch_up`; the undrain
        (stage 3) puts the cell back in rollout."""
        switch = self.restarts.pop(ref)
        result = ray.get(ref)
        index = switch.cell
        if switch.stage == 1:
            self.engine_version[index] = int((result or {}).get("version") or 0)
            return self._rejoin_catch_up(switch)
        if switch.stage == 2:
            loaded = ((result or {}).get("engine") or {}).get("version")
            self.engine_version[index] = switch.version if loaded is None else int(loaded)
            return self._rejoin_catch_up(switch)
        now = self._now()
        switch.event.update(rejoined_at_s=round(now, 3), rejoin_s=round(now - switch.since, 3),
                            version=self.engine_version[index])  # fmt: skip
        self.recorder.phase(index, self.views[index], CellPhase.ROLLOUT, now)
        self.recorder.loads(self, now)
        # (not expected: a publish sends a cell it finds undraining the version, and waits for it)
        if self.engine_version[index] < self.trainer_version:
            self.syncs[self.actors[index].update_weights.remote(self.weights, self.trainer_version)] = index
            self.engine_version[index] = self.trainer_version

    def _rejoin_catch_up(self, switch: Switch) -> None:
        """A restarted cell, still drained, serves only once it holds the published version or the one
        being published (`_serving_version`): load it (stage 2, again if a newer one came meanwhile),
        then undrain (stage 3; a publish that begins during the undrain sends it the new version)."""
        actor = self.actors[switch.cell]
        weights, version = self._serving_version()
        if self.engine_version[switch.cell] < version:
            switch.stage, switch.version = 2, version
            self.restarts[actor.update_weights.remote(weights, version)] = switch
            return
        switch.stage = 3
        self.restarts[actor.undrain.remote()] = switch

    def _settle_restarts(self) -> None:
        """Wait (bounded) for cells still rejoining, so a run ends with every cell it can have back."""
        deadline = time.monotonic() + REJOIN_SETTLE_S
        while self.restarts and time.monotonic() < deadline:
            ready, _ = ray.wait(
                list(self.restarts), num_returns=1, timeout=max(0.01, deadline - time.monotonic())
            )
            for ref in ready:
                if not self._check_loss(ref):
                    self._rejoin_done(ref)
