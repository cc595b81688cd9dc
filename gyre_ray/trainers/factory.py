"""Build the trainer the config asks for (`trainer.backend`)."""

from __future__ import annotations

import torch

from gyre_ray.model.arch import ModelArgs
from gyre_ray.trainers.base import LossFn, Trainer
from gyre_ray.trainers.config import TrainerSection


def make_trainer(
    section: TrainerSection, model: torch.nn.Module, args: ModelArgs, loss_fn: LossFn, *, version: int = 0
) -> Trainer:
    """A trainer for `section.backend`: "torch" here; "megatron" is not available yet."""
    if section.backend == "torch":
        from gyre_ray.trainers.torch_trainer import TorchTrainer

        return TorchTrainer(model, args, section, loss_fn, version=version)
    if section.backend == "megatron":
        raise NotImplementedError(
            "trainer.backend='megatron': the Megatron-core adapter is not available yet; use trainer.backend=torch"
        )
    raise ValueError(f"unknown trainer.backend {section.backend!r}; allowed: torch, megatron")
