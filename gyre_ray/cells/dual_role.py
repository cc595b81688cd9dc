"""A dual-role cell: a `RolloutCell` that also holds a trainer replica and switches between the two roles.

One role is active at a time. The switch protocol (the scheduler, `gyre_ray.runtime.scheduler`, drives it):

    cell.drain()                       # every proxy replica stops routing here; in-flight requests move with their KV
    cell.to_training(weights, v)       # engine releases memory, trainer loads weights v (core: keeps its own)
    cell.train(micro_batch) ...        # forward/backward, gradients *summed* (any number of calls)
    cell.export_grads()                # satellite: stage the sum for the core (and zero it here)
    cell.to_rollout(weights, v)        # trainer drops nothing un-exported; engine resumes and loads weights v
    cell.undrain()

Weights and gradients go through the transfer seam (`gyre_ray.transfer`, backends from the `transfer`
config section): the core's `publish_weights()` returns a `Ticket` that any cell method taking
`weights` accepts (a plain state dict still works), `export_grads()` returns a gradient ticket that
the core's `import_grads` fetches. With the collectives backend the cell is also a `CollectiveHost`:
`publish_weights()` broadcasts the new version to every cell that is there (a group formed for that
version), `import_grads` pulls a satellite's sum point to point, and a cell that missed a broadcast
(restarted since, say) fetches that version through the object store (`gyre_ray.transfer.collective`).

The **core** (the cell the runtime names, `is_core=True`) owns the authoritative weights and the
optimizer state. It imports the satellites' gradients (`import_grads`), steps once (`optimizer_step(scale)`, scale = 1 / executions)
and its `state_dict()` is what everyone loads next. The core keeps its accumulated gradients across
role switches (it is the step's accumulator); a satellite refuses to go back to rollout holding
gradients it has not exported, so no work can be lost silently. Trainer operations are serialised by a
lock, so an `import_grads` never races a backward pass. `switch_to_training` / `switch_to_rollout` do the
drain / undrain on the cell itself (its flag is what every proxy replica routes by). Plain Python: Ray
wraps it in `gyre_ray.cells.pool`, tests also run it in-process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gyre_ray.cells.cell import EngineFactory, RolloutCell
from gyre_ray.trainers.base import Trainer
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.transfer import Ticket, TransferError, Transport, make_transport
from gyre_ray.transfer.collective import CollectiveHost, CollectiveTransport
from gyre_ray.transfer.config import TransferSection
from gyre_ray.transfer.weights import WeightPublisher

ROLLOUT, TRAIN = "rollout", "train"


@dataclass
class TrainerFactory:
    """Builds the trainer replica inside the cell: the `model`, `trainer` and `algo` sections (dumped dicts);
    `transfer` is how the cell's weights and gradients move (the `transfer` section)."""

    model: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    algo: dict[str, Any] = field(default_factory=dict)
    transfer: dict[str, Any] = field(default_factory=dict)

    def transfer_section(self) -> TransferSection:
        """The validated `transfer` section."""
        return TransferSection.model_validate(self.transfer)

    def __call__(self) -> Trainer:
        from gyre_ray.algo import get_loss
        from gyre_ray.algo.config import AlgoSection
        from gyre_ray.model import load_policy
        from gyre_ray.model.config import ModelSection
        from gyre_ray.trainers.config import TrainerSection
        from gyre_ray.trainers.factory import make_trainer

        algo = AlgoSection.model_validate(self.algo)
        model, _, args = load_policy(ModelSection.model_validate(self.model))
        return make_trainer(
            TrainerSection.model_validate(self.trainer), model, args, get_loss(algo.name, algo)
        )


class DualRoleCell(RolloutCell, CollectiveHost):
    """A rollout cell that can become a trainer replica (and back) while the proxy keeps agents running.

    `peers`: the actor names of the run's cells (a collective broadcast goes to those that are there),
    `namespace`: theirs; both only matter with the collectives backend."""

    def __init__(
        self,
        cell_id: str,
        engine_factory: EngineFactory,
        trainer_factory: TrainerFactory,
        torch_threads: int | None = None,
        is_core: bool = False,
        stream_interval_s: float = 0.0,
        draining: bool = False,
        peers: list[str] | None = None,
        namespace: str | None = None,
    ) -> None:
        super().__init__(
            cell_id,
            engine_factory,
            torch_threads,
            stream_interval_s,
            transfer=trainer_factory.transfer,
            draining=draining,
        )
        self.trainer_factory = trainer_factory
        self.trainer: Trainer | None = None
        self.is_core = is_core  # the runtime says which cell is the core
        self._role = ROLLOUT
        self._lock = asyncio.Lock()
        self._publishing = asyncio.Lock()  # one `publish_weights` at a time (check, stage, push)
        self._trained = 0  # micro-batches trained here since the last export (or optimizer step)
        self._imports = 0  # gradient imports under way (their fetch runs outside the lock)
        self._no_imports = asyncio.Event()
        self._no_imports.set()
        self._peers, self._namespace = peers or [], namespace
        self._set_transports(trainer_factory.transfer_section())

    def _set_transports(self, section: TransferSection) -> None:
        """This cell's weights and gradients transports (one object when both use one backend)."""
        self._weights_tx: Transport = make_transport(section.weights, section, owner=self.cell_id)
        self._grads_tx: Transport = (
            self._weights_tx
            if section.gradients == section.weights
            else make_transport(section.gradients, section, owner=self.cell_id)
        )
        self._publisher = WeightPublisher(self._weights_tx)
        self._transports.update({section.weights: self._weights_tx, section.gradients: self._grads_tx})
        collective = self._collective_or_none()
        if collective is not None:
            import ray

            if ray.is_initialized() and ray.get_runtime_context().get_actor_name():
                collective.connect(ray.get_runtime_context().get_actor_name(), self._namespace, self._peers)

    async def use_transfer(self, transfer: dict[str, Any]) -> dict[str, str]:
        """Between runs: move weights and gradients through the backends of `transfer` (a `transfer`
        section, dumped) from now on; the old transports are closed, so earlier tickets are void."""
        section = TransferSection.model_validate(transfer)
        async with self._lock:
            for old in {id(t): t for t in (self._weights_tx, self._grads_tx)}.values():
                if self._transports.get(old.name) is old:
                    del self._transports[old.name]
                old.close()
            self._set_transports(section)
        return {"weights": section.weights, "gradients": section.gradients}

    async def setup(self) -> dict[str, Any]:
        """Build the engine and the trainer replica (heavy: both load the model); returns `status()`."""
        await super().setup()
        if self.trainer is None:
            self.trainer = await asyncio.to_thread(self.trainer_factory)
        return self.status()

    @property
    def role(self) -> str:
        return self._role

    def status(self) -> dict[str, Any]:
        status = super().status()
        trainer = self.trainer
        status.update(
            is_core=self.is_core,
            trainer_version=None if trainer is None else trainer.version,
            unexported_micro_batches=self._trained,
        )
        collective = self._collective_or_none()
        if collective is not None:
            status["collective"] = dict(collective.stats)
        return status

    # ---- role switches --------------------------------------------------------------------------
    async def to_training(
        self, weights: Ticket | dict[str, Any] | None, version: int, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Become a trainer: wait for migrated requests to leave, free the engine, load `weights` at `version`.

        The caller must have drained the cell in the proxy first. The core may pass `weights=None`
        (it keeps its authoritative weights); a satellite must pass the core's weights.
        """
        started = time.perf_counter()
        if self._role == TRAIN:
            raise RuntimeError(f"cell {self.cell_id} is already training")
        if not self.draining:
            raise RuntimeError(f"cell {self.cell_id}: drain it in the proxy before switching it to training")
        await self._wait_idle(timeout_s)
        await self._engine().release_memory()
        trainer = self._trainer()
        weights = await self._fetch(weights)
        async with self._lock:
            if weights is not None:
                await asyncio.to_thread(trainer.load_state_dict, weights, version)
            elif not self.is_core:
                raise ValueError(f"satellite {self.cell_id} needs the core's weights to train")
            elif trainer.version != version:
                raise RuntimeError(
                    f"core {self.cell_id} holds version {trainer.version}, asked for {version}"
                )
        self._role = TRAIN
        return {"seconds": time.perf_counter() - started, "version": trainer.version}

    async def to_rollout(
        self, weights: Ticket | dict[str, Any] | None, version: int, discard_grads: bool = False
    ) -> dict[str, Any]:
        """Become a rollout engine again, serving `weights` at `version` (core: its own when None).

        A satellite holding un-exported gradients refuses unless `discard_grads`; the core keeps its
        gradients (they are the step's accumulator). The caller undrains the cell afterwards.
        """
        started = time.perf_counter()
        if self._role != TRAIN:
            raise RuntimeError(f"cell {self.cell_id} is not training")
        trainer = self._trainer()
        weights = await self._fetch(weights)
        async with self._lock:
            if not self.is_core:
                if self._trained and not discard_grads:
                    raise RuntimeError(
                        f"satellite {self.cell_id} holds gradients of {self._trained} micro-batch(es): "
                        "export them to the core first"
                    )
                trainer.zero_grads()
                self._trained = 0
            if weights is None:
                if not self.is_core:
                    raise ValueError(f"satellite {self.cell_id} needs weights to serve")
                weights = await asyncio.to_thread(trainer.state_dict)
                version = trainer.version
        engine = self._engine()
        await engine.resume_memory()
        await engine.update_weights(weights, version)
        self._role = ROLLOUT
        return {"seconds": time.perf_counter() - started, "version": version}

    async def switch_to_training(
        self, weights: Ticket | dict[str, Any] | None, version: int, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Drain (this cell's own flag, which every proxy replica routes by), then `to_training`.

        Returns `to_training`'s result plus `migrated` (requests exported) and `drain_s`.
        """
        started = time.perf_counter()
        migrated = await self.drain()
        drain_s = time.perf_counter() - started
        result = await self.to_training(weights, version, timeout_s)
        result.update(migrated=migrated, drain_s=drain_s, seconds=time.perf_counter() - started)
        return result

    async def switch_to_rollout(
        self, weights: Ticket | dict[str, Any] | None, version: int, discard_grads: bool = False
    ) -> dict[str, Any]:
        """`to_rollout`, then undrain: every proxy replica routes here again once it reads the flag."""
        result = await self.to_rollout(weights, version, discard_grads)
        await self.undrain()
        return result

    async def load_and_undrain(self, weights: Ticket | dict[str, Any] | None, version: int) -> dict[str, Any]:
        """A cell back in rollout: load `weights` (the version published during its switch) if given, then undrain."""
        if weights is not None:
            await self._engine().update_weights(await self._fetch(weights), version)
        await self.undrain()
        return {"version": self._engine().stats().get("version")}

    async def rejoin(self, weights: Ticket | dict[str, Any] | None, version: int) -> dict[str, Any]:
        """A restarted cell (started drained): build engine and trainer, load the published `weights`
        at `version` into the engine. It stays drained: the caller loads a version published meanwhile
        (`update_weights`), then undrains it (`CellRecovery._rejoin_done`)."""
        await self.setup()
        if weights is not None:
            await self._engine().update_weights(await self._fetch(weights), version)
        return {"version": self._engine().stats().get("version")}

    async def load_trainer_weights(self, weights: Ticket | dict[str, Any], version: int) -> dict[str, Any]:
        """A training satellite takes the newly published version before its next micro-step."""
        started = time.perf_counter()
        if self.is_core:
            raise RuntimeError(f"core {self.cell_id} owns the weights; it does not load them")
        trainer = self._trainer()
        weights = await self._fetch(weights)
        async with self._lock:
            if self._trained:
                raise RuntimeError(
                    f"satellite {self.cell_id} holds gradients of {self._trained} micro-batch(es) "
                    "of the previous version: export them first"
                )
            await asyncio.to_thread(trainer.load_state_dict, weights, version)
        return {"seconds": time.perf_counter() - started, "version": version}

    async def update_weights(self, state_dict: Ticket | dict[str, Any], version: int) -> dict[str, Any]:
        """A rollout cell loads a published version (a weight ticket or a state dict) at its next safe point."""
        return await super().update_weights(await self._fetch(state_dict), version)

    def versions(self) -> dict[str, Any]:
        """Role, the trainer's version and the engine's version."""
        engine = self.engine.stats().get("version") if self.engine is not None else None
        return {"role": self._role, "trainer": self._trainer().version, "engine": engine}

    # ---- training -------------------------------------------------------------------------------
    async def train(self, batch: MicroBatch) -> dict[str, Any]:
        """Forward/backward on one micro-batch; gradients add to what this replica holds (sum semantics)."""
        if self._role != TRAIN:
            raise RuntimeError(f"cell {self.cell_id} is not training (role {self._role})")
        trainer = self._trainer()
        started = time.perf_counter()
        async with self._lock:
            metrics = await asyncio.to_thread(trainer.forward_backward, batch)
        self._trained += 1
        metrics["seconds"] = time.perf_counter() - started
        return metrics

    async def export_grads(self) -> Ticket:
        """Stage the summed gradients of this replica for the core (a ticket); they are zeroed here."""
        trainer = self._trainer()
        async with self._lock:
            grads = await asyncio.to_thread(trainer.export_grads)
            trainer.zero_grads()
            self._trained = 0
            version = trainer.version
        return await asyncio.to_thread(self._grads_tx.stage, grads, kind="grads", version=version, dst_rank=0)

    async def import_grads(self, grads: Ticket | dict[str, Any]) -> int:
        """Core: add a satellite's exported gradients (a ticket, or a dict by name); returns how many tensors."""
        self._require_core("import_grads")
        trainer = self._trainer()
        self._imports += 1
        self._no_imports.clear()
        try:
            if isinstance(grads, Ticket):
                grads = await asyncio.to_thread(self._grads_tx.fetch, grads)
            async with self._lock:
                await asyncio.to_thread(trainer.import_grads, grads)
        finally:
            self._imports -= 1
            if not self._imports:
                self._no_imports.set()
        return len(grads)

    async def optimizer_step(self, scale: float) -> dict[str, float]:
        """Core: scale the summed gradients once by `scale`, clip, step; the new version is then published."""
        self._require_core("optimizer_step")
        trainer = self._trainer()
        async with self._lock:
            metrics = await asyncio.to_thread(trainer.optimizer_step, scale)
            self._trained = 0
        return metrics

    async def state_dict(self) -> dict[str, Any]:
        """The trainer's weights (core: the authoritative ones), for satellites and engines."""
        trainer = self._trainer()
        async with self._lock:
            return await asyncio.to_thread(trainer.state_dict)

    async def publish_weights(self) -> Ticket:
        """Core: stage the authoritative weights at the trainer's version; the ticket is what cells load.

        A version publishes once: asked again (a restarted scheduler), the core returns its ticket, and
        one asked while the same version is being staged waits for that publish (`_publishing`)."""
        self._require_core("publish_weights")
        trainer = self._trainer()
        async with self._publishing:  # staging and pushing run outside `_lock`: one publish at a time
            async with self._lock:
                last = self._publisher.last
                if last is not None and last.version == trainer.version:
                    return last
                state = await asyncio.to_thread(trainer.state_dict)
                version = trainer.version
            ticket = await asyncio.to_thread(self._publisher.publish, state, version)
            await asyncio.to_thread(self._weights_tx.push, ticket)  # collectives: the broadcast; else a no-op
            return ticket

    async def discard_grads(self) -> int:
        """Drop the gradients this replica holds (a restarted scheduler trains its step again); returns
        how many micro-batches they summed. Imports under way (a dead scheduler's, still fetching
        their gradients) land first: one landing after would add micro-batches trained again."""
        trainer = self._trainer()
        await self._no_imports.wait()
        async with self._lock:
            trainer.zero_grads()
            dropped, self._trained = self._trained, 0
        return dropped

    def trainer_version(self) -> int:
        return self._trainer().version

    async def settled_version(self) -> int:
        """The trainer's version once no locked work (an optimizer step, a gradient import) is under
        way: a restarted scheduler reads it, and `trainer_version` would answer mid-step with the
        version before it (the step would then be taken twice). Gradient imports under way (whose fetch
        holds no lock) are waited for too."""
        trainer = self._trainer()
        await self._no_imports.wait()
        async with self._lock:
            return trainer.version

    async def save(self, folder: str) -> str:
        """Core: write the checkpoint (HF folder + optimizer state); returns the folder."""
        self._require_core("save")
        trainer = self._trainer()
        async with self._lock:
            return str(await asyncio.to_thread(trainer.save, folder))

    async def load(self, folder: str) -> int:
        """Core: restore a `save`d trainer folder (weights, optimizer, step, version, RNG); returns the version."""
        self._require_core("load")
        trainer = self._trainer()
        async with self._lock:
            await asyncio.to_thread(trainer.load, folder)
            self._trained = 0
            return trainer.version

    # ---- internals ------------------------------------------------------------------------------
    def _collective_or_none(self) -> CollectiveTransport | None:
        for transport in (self._weights_tx, self._grads_tx):
            if isinstance(transport, CollectiveTransport):
                return transport
        return None

    def _collective(self) -> CollectiveTransport:
        collective = self._collective_or_none()
        if collective is None:
            raise RuntimeError(f"cell {self.cell_id}: no transfer backend is collective here")
        return collective

    async def _fetch(self, weights: Ticket | dict[str, Any] | None) -> dict[str, Any] | None:
        """A weight ticket's state dict, fetched through this cell's transport (a dict or None as given)."""
        if isinstance(weights, Ticket):
            if weights.backend != self._weights_tx.name:
                raise TransferError(
                    f"{self.cell_id}: {weights.describe()} came by another backend than this cell's "
                    f"transfer.weights={self._weights_tx.name}"
                )
            return await asyncio.to_thread(self._weights_tx.fetch, weights)
        return weights

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"cell {self.cell_id} has no trainer: call setup() first")
        return self.trainer

    def _require_core(self, what: str) -> None:
        if not self.is_core:
            raise RuntimeError(f"{what} runs on the core only; {self.cell_id} is a satellite")

    async def _wait_idle(self, timeout_s: float) -> None:
        """Wait until every drained request has left (their streams end right after the export)."""
        deadline = time.monotonic() + timeout_s
        while self._inflight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {self.cell_id}: {len(self._inflight)} request(s) still in flight")
            await asyncio.sleep(0.005)
