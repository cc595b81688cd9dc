"""float32 master weights for a model held in bfloat16 or float16, which the optimizer steps.

An AdamW step moves a weight by about the learning rate (1e-5 by default), less than half a bfloat16
rounding step for any weight above about 2e-3 in magnitude: stepped in place, most updates round
away and the weight never moves. So a trainer whose parameters are half precision keeps a float32
copy of each (and AdamW's moments in float32 with them), hands the optimizer those, and copies them
back into the model after each step. Gradients still accumulate in the model's dtype (`param.grad`,
as autograd writes them); they are widened to float32 for the step. A float32 or float64 model needs
none of this (`MasterWeights.needed` is False).
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


class MasterWeights:
    """float32 copies of `params` (the model's, by name); `tensors` are what the optimizer steps."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.master = {name: p.detach().float().clone() for name, p in params.items()}

    @staticmethod
    def needed(params: dict[str, torch.nn.Parameter]) -> bool:
        return any(p.dtype in HALF for p in params.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self.master.values())

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step `optimizer` (built over `tensors()`) on the model's gradients, then copy the result back."""
        for name, param in self.params.items():
            self.master[name].grad = None if param.grad is None else param.grad.float()
        optimizer.step()
        for name, param in self.params.items():
            self.master[name].grad = None
            param.copy_(self.master[name])

    @torch.no_grad()
    def reload(self, params: dict[str, torch.nn.Parameter]) -> None:
        """The model's weights were replaced (`load_state_dict`): take them (and the new parameters)."""
        self.params = params
        for name, param in params.items():
            self.master[name].copy_(param)

    def state(self) -> dict[str, torch.Tensor]:
        """The float32 weights, for a checkpoint (the model's half-precision copy loses their low bits)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.master.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state()`, then round the model's weights from it."""
        for name, tensor in state.items():
            if name in self.master:
                self.master[name].copy_(tensor)
        for name, param in self.params.items():
            param.copy_(self.master[name])
