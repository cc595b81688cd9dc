"""The trainer interface every backend implements (torch on CPU, Megatron-core on GPU).

A trainer holds one replica of the policy and its optimizer. Gradients accumulate with *sum*
semantics across `forward_backward` calls and across replicas (`export_grads` on a satellite,
`import_grads` on the core); only `optimizer_step(scale)` scales them, once, by a factor the
caller chooses (e.g. 1 / number of executions). So the update does not depend on how micro-batches
were spread over calls or cells.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.master import MasterWeights

# loss_fn(token_logprobs (B, T), batch) -> (scalar loss to backpropagate, metrics). Where the batch has
# a `loss_mask` the torch trainer scores those tokens alone (the others read 0): a loss reads no other.
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, float]]]


@torch.no_grad()
def add_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Sum `grad` into `param.grad` (sum semantics across micro-batches and replicas)."""
    grad = grad.to(device=param.device, dtype=param.dtype)
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)


def make_optimizer(
    params: dict[str, torch.nn.Parameter], section: TrainerSection
) -> tuple[torch.optim.Optimizer, MasterWeights | None]:
    """AdamW over `params`, or over float32 master copies of them when they are half precision
    (`gyre_ray.trainers.master`; the second item, None for a float32 or float64 model)."""
    master = MasterWeights(params) if MasterWeights.needed(params) else None
    stepped = master.tensors() if master is not None else list(params.values())
    optimizer = torch.optim.AdamW(stepped, lr=section.lr)
    set_hyperparameters(optimizer, section)
    return optimizer, master


def set_hyperparameters(optimizer: torch.optim.Optimizer, section: TrainerSection) -> None:
    """The section's lr, betas, eps and weight decay on every parameter group; after loading a
    checkpoint's optimizer state too, which brings the saved run's values (a resume may change them)."""
    for group in optimizer.param_groups:
        group.update(
            lr=section.lr, betas=tuple(section.betas), eps=section.eps, weight_decay=section.weight_decay
        )


def apply_step(trainer: Any, grad_norm: float) -> dict[str, float]:
    """The end of every backend's `optimizer_step`, once the gradients are scaled and clipped: step the
    optimizer (never on a NaN / inf norm: that step's gradients are dropped instead), bump step and
    version, zero the gradients; returns the step's metrics."""
    metrics = {"grad_norm": grad_norm, "lr": trainer.optimizer.param_groups[0]["lr"], "skipped": 0.0}
    if math.isfinite(grad_norm):
        master = getattr(trainer, "master", None)
        if master is not None:
            master.step(trainer.optimizer)
        else:
            trainer.optimizer.step()
        trainer.step += 1
        trainer.version += 1
    else:
        metrics["skipped"] = 1.0
    trainer.zero_grads()
    metrics.update(step=float(trainer.step), version=float(trainer.version))
    return metrics


class Trainer(abc.ABC):
    """Forward/backward on micro-batches, gradient exchange, optimizer steps, checkpoints."""

    version: int  # weight version: bumped by every optimizer step, set by load_state_dict / load
    step: int  # optimizer steps taken

    @abc.abstractmethod
    def forward_backward(self, batch: MicroBatch) -> dict[str, float]:
        """Add the gradients of `loss_fn` on `batch` to the accumulated ones; return its metrics."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """Per-token log-probabilities (B, T) under the current weights, without gradients."""

    @abc.abstractmethod
    def export_grads(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients as CPU tensors by parameter name (zeros where none yet)."""

    @abc.abstractmethod
    def import_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add `grads` (as from export_grads of another replica) to the accumulated gradients."""

    @abc.abstractmethod
    def zero_grads(self) -> None:
        """Drop the accumulated gradients."""

    @abc.abstractmethod
    def optimizer_step(self, scale: float) -> dict[str, float]:
        """Multiply gradients by `scale`, clip, step the optimizer, zero gradients; returns grad_norm etc."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model weights (HF parameter names, CPU tensors) for engines and satellites."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights with `state` and adopt `version` (optimizer state is kept)."""

    @abc.abstractmethod
    def save(self, folder: str | Path) -> Path:
        """Write weights (HF folder), optimizer state, step, version and RNG states."""

    @abc.abstractmethod
    def load(self, folder: str | Path) -> None:
        """Restore everything `save` wrote."""

    def metadata(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step}
