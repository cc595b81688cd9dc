"""`RayTensorParallelTrainer`: tensor-parallel Megatron ranks as Ray actors inside the cell's placement group.

Inside a Ray worker (a cell actor) this is what `trainer.backend=megatron` with
`trainer.tensor_parallel_size` x `trainer.context_parallel_size` > 1 builds
(`trainer.tensor_parallel_workers`, default `auto`): one
actor per rank, scheduled into the caller's placement group and bundle (the cell's), each its own
process and so its own torch.distributed world (Megatron owns a process' default group, which is
why the ranks cannot share the cell's process). The cell's process serves the TCP store the ranks
rendezvous at (its node's address, a free port); gloo on CPU, NCCL on GPU.

Rank actors of a named caller are named `<caller>-tp<rank>` (e.g. `cell-0-tp1`, in the job's namespace;
`<rank>` is the rank in the cell's world, tensor x context parallel).
Resources: the cell actor already holds its bundle, so rank actors ask for no CPUs or GPUs of their
own (`num_cpus=0`); on GPU, rank r sees the cell's r-th GPU (`CUDA_VISIBLE_DEVICES` from the cell's
`ray.get_gpu_ids()`). Every call goes to all ranks in the same order (Ray keeps one caller's calls to
an actor in order); a dict of tensors is put in the object store once and every rank reads that one
copy (the object-store transport's path); rank 0's answer comes back. A `ValueError` (bad input) is
re-raised as one; any other rank failure is a `RankError` naming the rank.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist

from gyre_ray.model.arch import ModelArgs
from gyre_ray.trainers.base import LossFn
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.megatron.tensor_parallel import RankDrivenTrainer, RankError, build_rank, rank_init


class RankActor:
    """One Megatron rank (wrapped by `ray.remote` at use)."""

    def __init__(self, rank: int, host: str, port: int, init: dict[str, Any], threads: int) -> None:
        self.rank = rank
        self.trainer = build_rank(rank, host, port, init, threads)

    def ready(self) -> int:
        return self.rank

    def placement(self) -> str | None:
        """The id (hex) of the placement group this rank runs in, None outside one."""
        from ray.util.placement_group import get_current_placement_group

        group = get_current_placement_group()
        return None if group is None else group.id.hex()

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.trainer, method)(*args)
        return result if self.rank == 0 else None


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        with contextlib.suppress(Exception):  # already gone with the cluster
            ray.kill(actor, no_restart=True)


class RayTensorParallelTrainer(RankDrivenTrainer):
    """`section.megatron_ranks` Megatron ranks (tensor x context parallel) as Ray actors, driven as one
    trainer."""

    def __init__(
        self,
        hf_state: dict[str, torch.Tensor],
        args: ModelArgs,
        section: TrainerSection,
        loss_fn: LossFn,
        *,
        version: int = 0,
        placement_group: Any = None,
        bundle_index: int = 0,
        threads_per_rank: int = 1,
        timeout_s: float = 600.0,
    ) -> None:
        """`placement_group`: where the ranks go (default: the caller's own, if it has one)."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.args, self.section, self.timeout_s = args, section, timeout_s
        ranks = section.megatron_ranks
        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, world_size=ranks, is_master=True, wait_for_workers=False)
        init = ray.put(rank_init(hf_state, args, section, loss_fn, version))
        group = placement_group if placement_group is not None else get_current_placement_group()
        gpus = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        actor_cls = ray.remote(RankActor)
        owner = ray.get_runtime_context().get_actor_name() if inside_ray_worker() else None
        self._actors = []
        for rank in range(ranks):
            options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
            if owner:  # e.g. "cell-0-tp1" (in the job's namespace)
                options["name"] = f"{owner}-tp{rank}"
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle_index
                )
            if gpus:
                env = {"CUDA_VISIBLE_DEVICES": gpus[rank % len(gpus)]}
                options["runtime_env"] = {"env_vars": env}
            self._actors.append(
                actor_cls.options(**options).remote(rank, host, self._store.port, init, threads_per_rank)
            )
        self._finalizer = weakref.finalize(self, _kill, list(self._actors))
        try:
            self._gather([actor.ready.remote() for actor in self._actors], "start")
        except BaseException:
            self.close()
            raise
        self.version, self.step = version, 0

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def close(self) -> None:
        """Kill the rank actors (idempotent)."""
        self._finalizer()

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except ValueError:
                raise
            except Exception as exc:
                self.close()  # the other ranks may wait in a collective for it: none would serve again
                why = (
                    f"no answer to {what} within {self.timeout_s:.0f} s"
                    if isinstance(exc, ray.exceptions.GetTimeoutError)
                    else f"failed in {what}: {exc}"
                )
                raise RankError(
                    f"Megatron rank actor {rank}: {why}; the trainer's rank actors are ended"
                ) from None
        return results

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        if not self._finalizer.alive:
            raise RankError("this tensor-parallel trainer is closed")
        # weights, gradients and micro-batches: one object-store copy for all ranks
        shared = [a if isinstance(a, (int, float, str, bool, type(None))) else ray.put(a) for a in args]
        return self._gather([actor.call.remote(method, *shared) for actor in self._actors], method)[0]


def inside_ray_worker() -> bool:
    """True in a Ray worker process (a cell actor), where rank actors can join its placement group."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:
        return False
