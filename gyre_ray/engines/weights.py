"""The engine's hold on its model weights: load a new state dict in place, free and re-allocate storage.

`release()` frees the parameters' storage (the cell is about to train and needs the memory);
`resume()` re-allocates it uninitialised, and the engine does not step again until `load()` has
filled it with a version's weights. With `free_on_release=False` (a model object shared with a
trainer in the same process) release and resume leave the weights alone. Either way release frees
the packed inference copies (`gyre_ray.model.packed_linear`), rebuilt from the weights on next use.
"""

from __future__ import annotations

from typing import Any

import torch

from gyre_ray.engines.base import EngineInputError
from gyre_ray.model.checkpoint import load_state_into
from gyre_ray.model.packed_linear import free_packed_copies


class WeightHolder:
    """Loads, frees and re-allocates the parameters of one model."""

    def __init__(self, model: torch.nn.Module, free_on_release: bool = True) -> None:
        self.model = model
        self.free_on_release = free_on_release
        self.loaded = True
        self._shapes: list[tuple[torch.nn.Parameter, torch.Size]] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def load(self, state_dict: dict[str, Any]) -> None:
        """Copy `state_dict` (HF names; a tied lm_head may be absent) into the parameters."""
        if not isinstance(state_dict, dict):
            raise EngineInputError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        self.resume()
        state = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        try:
            load_state_into(self.model, state, dtype=self.dtype)
        except ValueError as exc:
            raise EngineInputError(str(exc)) from None
        self.loaded = True

    def release(self) -> None:
        free_packed_copies(self.model)  # inference copies: rebuilt from the parameters at their next use
        if not self.free_on_release or self._shapes is not None:
            return
        self._shapes = []
        for param in self.model.parameters():
            self._shapes.append((param, param.shape))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.loaded = False

    def resume(self) -> None:
        if self._shapes is None:
            return
        for param, shape in self._shapes:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self._shapes = None
