"""`TensorParallelTrainer`: a `Trainer` whose Megatron ranks (tensor x context parallel) run as spawned
processes.

Each rank process builds a `MegatronTrainer` (its shards, its AdamW state) and joins one
torch.distributed world through a `TCPStore` this process serves on 127.0.0.1 (a free port chosen by
the OS, so nothing is hard-coded; gloo on CPU, NCCL on GPU). Every call goes to all ranks in the same
order (the collectives inside need it); rank 0's answer is returned, and a failure on any rank is
raised here with that rank's traceback. The ranks are separate processes rather than threads or Ray
collectives because Megatron owns each process's default process group (Ray's gloo group would
initialise the same one).

The owner holds the ranks: they end with `close()`, when this object is collected, or with the
owning process (they are daemonic).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gyre_ray.model.arch import ModelArgs
from gyre_ray.trainers.base import LossFn, Trainer
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trainers.config import TrainerSection

HOST = "127.0.0.1"


def default_threads(ranks: int) -> int:
    """torch threads per rank: this machine's CPUs shared among the ranks."""
    return max(1, (os.cpu_count() or 1) // ranks)


class RankError(RuntimeError):
    """A Megatron rank failed; the message carries its traceback."""


def _dump_loss(loss_fn: LossFn) -> bytes:
    try:
        return pickle.dumps(loss_fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        from ray import cloudpickle  # closures (e.g. the configured GSPO loss) need cloudpickle

        return cloudpickle.dumps(loss_fn)


def rank_init(
    hf_state: dict[str, torch.Tensor], args: ModelArgs, section: TrainerSection, loss_fn: LossFn, version: int
) -> dict[str, Any]:
    """What every rank needs to build its trainer (picklable: the loss travels cloudpickled)."""
    return {
        "hf_state": {k: v.detach().cpu().contiguous() for k, v in hf_state.items()},
        "args": args,
        "section": section.model_dump(),
        "loss": _dump_loss(loss_fn),
        "version": version,
    }


def build_rank(rank: int, host: str, port: int, init: dict[str, Any], threads: int) -> Any:
    """This process' `MegatronTrainer` as `rank`, joined to the world served by the TCP store at host:port."""
    from gyre_ray.trainers.megatron.trainer import MegatronTrainer

    torch.set_num_threads(threads)
    section = TrainerSection.model_validate(init["section"])
    store = dist.TCPStore(host, port, world_size=section.megatron_ranks, is_master=False)
    return MegatronTrainer(
        init["hf_state"],
        init["args"],
        section,
        pickle.loads(init["loss"]) if isinstance(init["loss"], bytes) else init["loss"],
        version=init["version"],
        rank=rank,
        store=store,
    )


def _rank_main(conn: Connection, rank: int, port: int, init: dict[str, Any], threads: int) -> None:
    """A rank's process: build its trainer, then run the calls that arrive until "close"."""
    try:
        trainer = build_rank(rank, HOST, port, init, threads)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the owner is gone
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            result = getattr(trainer, method)(*args)
            reply = ("ok", result if rank == 0 else None)
        except Exception as exc:
            kind = "input" if isinstance(exc, ValueError) else "error"
            reply = (kind, f"{type(exc).__name__}: {exc}" if kind == "input" else traceback.format_exc())
        conn.send(reply)


def _stop(processes: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # a rank that already died
            conn.send(("close", ()))
    for proc in processes:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


class RankDrivenTrainer(Trainer):
    """The `Trainer` interface over Megatron ranks: every call goes to all of them (`_call`),
    rank 0's answer comes back. Subclasses own the ranks (processes here, Ray actors in `ray_ranks`)."""

    args: ModelArgs
    section: TrainerSection

    def _call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ the Trainer interface
    def forward_backward(self, batch: MicroBatch) -> dict[str, float]:
        return self._call("forward_backward", batch)

    def compute_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        return self._call("compute_logprobs", batch)

    def export_grads(self) -> dict[str, torch.Tensor]:
        return self._call("export_grads")

    def import_grads(self, grads: dict[str, torch.Tensor]) -> None:
        self._call("import_grads", grads)

    def zero_grads(self) -> None:
        self._call("zero_grads")

    def optimizer_step(self, scale: float) -> dict[str, float]:
        metrics = self._call("optimizer_step", scale)
        self.step, self.version = int(metrics["step"]), int(metrics["version"])
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        self._call("load_state_dict", state, version)
        self.version = version

    def save(self, folder: str | Path) -> Path:
        return self._call("save", str(folder))

    def load(self, folder: str | Path) -> None:
        self._call("load", str(folder))
        meta = self._call("metadata")
        self.step, self.version = int(meta["step"]), int(meta["version"])

    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            "backend": "megatron",
            "tensor_parallel_size": self.section.tensor_parallel_size,
            "context_parallel_size": self.section.context_parallel_size,
        }


class TensorParallelTrainer(RankDrivenTrainer):
    """`section.megatron_ranks` Megatron ranks (tensor x context parallel) in child processes, driven
    as one trainer."""

    def __init__(
        self,
        hf_state: dict[str, torch.Tensor],
        args: ModelArgs,
        section: TrainerSection,
        loss_fn: LossFn,
        *,
        version: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        self.args, self.section, self.timeout_s = args, section, timeout_s
        ranks = section.megatron_ranks
        self._store = dist.TCPStore(HOST, 0, world_size=ranks, is_master=True, wait_for_workers=False)
        init = rank_init(hf_state, args, section, loss_fn, version)
        threads = default_threads(ranks)
        ctx = mp.get_context("spawn")
        self._conns, self._processes = [], []
        for rank in range(ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(child, rank, self._store.port, init, threads), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._processes.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._conns)
        try:
            self._collect("start")
        except BaseException:
            self.close()
            raise
        self.version, self.step = version, 0

    def close(self) -> None:
        """End the rank processes (idempotent)."""
        self._finalizer()

    def _collect(self, what: str) -> Any:
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout_s):
                # the other ranks' replies (or their wait in a collective) would answer the next call
                self.close()
                raise RankError(
                    f"Megatron rank {rank}: no answer to {what} within {self.timeout_s:.0f} s; "
                    "the trainer's rank processes are ended"
                )
            replies.append(conn.recv())
        for rank, (kind, payload) in enumerate(replies):
            if kind == "input":
                raise ValueError(payload)
            if kind != "ok":
                raise RankError(f"Megatron rank {rank} failed in {what}:\n{payload}")
        return replies[0][1]

    def _call(self, method: str, *args: Any) -> Any:
        if not self._finalizer.alive:
            raise RankError("this tensor-parallel trainer is closed")
        for conn in self._conns:
            conn.send((method, args))
        return self._collect(method)
