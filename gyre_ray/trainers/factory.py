"""Build the trainer the config asks for (`trainer.backend`)."""

from __future__ import annotations

import torch

from gyre_ray.model.arch import ModelArgs
from gyre_ray.trainers.base import LossFn, Trainer
from gyre_ray.trainers.config import TrainerSection


def make_trainer(
    section: TrainerSection, model: torch.nn.Module, args: ModelArgs, loss_fn: LossFn, *, version: int = 0
) -> Trainer:
    """A trainer for `section.backend` over `model`'s weights: "torch" or "megatron" (megatron-core)."""
    if section.backend == "torch":
        from gyre_ray.trainers.torch_trainer import TorchTrainer

        return TorchTrainer(model, args, section, loss_fn, version=version)
    if section.backend == "megatron":
        from gyre_ray.trainers.megatron import make_megatron_trainer

        return make_megatron_trainer(section, model.state_dict(), args, loss_fn, version=version)
    raise ValueError(f"unknown trainer.backend {section.backend!r}; allowed: torch, megatron")
