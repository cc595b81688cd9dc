"""Policy-gradient objectives, registered by name: `get_loss("gspo", cfg.algo)` -> the trainer's loss_fn.

A loss_fn has the trainer's signature `loss_fn(log_probs (B, T), batch: MicroBatch) -> (loss, metrics)`;
its loss is the SUM over the micro-batch's executions, so the trainer sums micro-batch gradients and
scales the step by `step_scale(batches)` (1 / executions in the step).

Imports are lazy: the config tree imports `gyre_ray.algo.config`, which must not load torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre_ray.algo.config import AlgoSection

# name -> "module:factory"; a factory takes the `algo` config section and returns a loss_fn.
LOSSES: dict[str, str] = {"gspo": "gyre_ray.algo.gspo:make_tree_gspo_loss"}
_LAZY = {
    "gspo_loss": "gyre_ray.algo.gspo",
    "tree_gspo_loss": "gyre_ray.algo.gspo",
    "step_scale": "gyre_ray.algo.gspo",
    "group_advantages": "gyre_ray.algo.advantages",
}


def get_loss(name: str, cfg: AlgoSection | None = None) -> Callable[..., Any]:
    """The trainer loss_fn registered as `name`, configured by `cfg` (the `algo` section; defaults if None)."""
    if name not in LOSSES:
        raise KeyError(f"unknown loss {name!r}; registered: {', '.join(sorted(LOSSES))}")
    module, factory = LOSSES[name].split(":")
    if cfg is None:
        from gyre_ray.algo.config import AlgoSection

        cfg = AlgoSection()
    return getattr(importlib.import_module(module), factory)(cfg)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gyre_ray.algo' has no attribute {name!r}")


__all__ = ["LOSSES", "get_loss", *_LAZY]
