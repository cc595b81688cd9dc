"""The Megatron-core trainer backend (`trainer.backend=megatron`).

`make_megatron_trainer` returns a `Trainer`: `MegatronTrainer` in this process for one rank (tensor
and context parallel 1); for more, `RayTensorParallelTrainer` (one Ray actor per rank in the caller's
placement group) inside a Ray worker such as a cell actor, else `TensorParallelTrainer` (one spawned
process per rank); gloo or NCCL between the ranks (`trainer.tensor_parallel_workers` chooses).
Modules: `convert` (HF <-> Megatron names and tensor-parallel shards, pure tensors), `build` (process
groups, `GPTModel` from `ModelArgs`), `cpu_shims` (the two CPU shims), `trainer`, `tree_core` (tree
attention as Megatron's core attention), `context_parallel` (a micro-batch's columns split among
ranks), `tensor_parallel`, `ray_ranks`.
Imports are lazy: megatron-core loads only when a Megatron trainer is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.trainers.base import LossFn, Trainer
    from gyre_ray.trainers.config import TrainerSection


def make_megatron_trainer(
    section: TrainerSection,
    hf_state: dict[str, torch.Tensor],
    args: ModelArgs,
    loss_fn: LossFn,
    *,
    version: int = 0,
) -> Trainer:
    """A Megatron trainer over HF-named weights `hf_state` on `section.megatron_ranks` ranks (tensor x
    context parallel; one: in this process)."""
    from gyre_ray.trainers.megatron.build import check_divisible

    check_divisible(args, section.tensor_parallel_size)
    if section.megatron_ranks == 1:
        from gyre_ray.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer(hf_state, args, section, loss_fn, version=version)
    from gyre_ray.trainers.megatron.ray_ranks import inside_ray_worker
    from gyre_ray.trainers.megatron.tensor_parallel import default_threads

    workers = section.tensor_parallel_workers
    if workers == "ray" or (workers == "auto" and inside_ray_worker()):
        from gyre_ray.trainers.megatron.ray_ranks import RayTensorParallelTrainer

        threads = default_threads(section.megatron_ranks)
        return RayTensorParallelTrainer(
            hf_state, args, section, loss_fn, version=version, threads_per_rank=threads
        )
    from gyre_ray.trainers.megatron.tensor_parallel import TensorParallelTrainer

    return TensorParallelTrainer(hf_state, args, section, loss_fn, version=version)
