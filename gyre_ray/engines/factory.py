"""Build the rollout engine the config asks for (`engine.backend`)."""

from __future__ import annotations

from typing import Any

import torch

from gyre_ray.engines.base import RolloutEngine
from gyre_ray.engines.config import EngineSection
from gyre_ray.model.arch import ModelArgs


def make_engine(
    section: EngineSection,
    model: torch.nn.Module | None,
    args: ModelArgs,
    *,
    version: int = 0,
    **options: Any,
) -> RolloutEngine:
    """An engine for `section.backend`: "torch" (in this process) or "sglang" (a server per cell, GPU).

    `options` go to the backend (e.g. `stop_token_ids`; torch: `free_weights_on_release`; sglang:
    `model_dir`, the HF folder its server loads, see `gyre_ray.engines.sglang.launch_engine`).
    `model` may be None only for sglang with a `model_dir`.
    """
    if section.backend == "torch":
        options.pop("model_dir", None)
        if model is None:
            raise ValueError("engine.backend=torch needs the policy model in this process")
        from gyre_ray.engines.torch_engine import TorchEngine

        return TorchEngine(
            model,
            args,
            max_batch_size=section.max_batch_size,
            prefix_cache_tokens=section.prefix_cache_tokens,
            prefill_chunk_tokens=section.prefill_chunk_tokens,
            torch_threads=section.torch_threads or None,
            version=version,
            **options,
        )
    if section.backend == "sglang":
        from gyre_ray.engines.sglang import launch_engine

        return launch_engine(section, model, args, version=version, **options)
    raise ValueError(f"unknown engine.backend {section.backend!r}; allowed: torch, sglang")
