"""The torch trainer: forward/backward on packed or tree micro-batches, summed gradients, AdamW.

Runs wherever the model's parameters live (CPU by default). Tree-packed rows go through the
block-sparse attention plan (`gyre_ray.model.attention`) and the chunked target log-probs
(`trainers.batch.target_logprobs`), so neither the tree mask nor the vocabulary costs a dense pass. Gradients only ever add up, within a
trainer (successive `forward_backward` calls) and across trainers (`export_grads` / `import_grads`);
`optimizer_step(scale)` is the single place where they are scaled, then clipped, then applied.
A bfloat16 or float16 model is stepped through float32 master weights (`trainers.master`).
`save` writes an HF model folder plus `trainer_state.pt` (optimizer, step, version, RNG states, the
master weights where there are), so the folder also loads in transformers.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import load_state_into, read_hf_weights, save_hf
from gyre_ray.trainers.base import LossFn, Trainer, add_grad, apply_step, make_optimizer, set_hyperparameters
from gyre_ray.trainers.batch import MicroBatch, batch_problem, model_logprobs
from gyre_ray.trainers.config import TrainerSection

STATE_FILE = "trainer_state.pt"


class TrainerInputError(ValueError):
    """A micro-batch or gradient dict that does not fit the model (the message names the field)."""


class TorchTrainer(Trainer):
    """`Trainer` over a gyre-ray `Qwen3ForCausalLM` in this process."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: ModelArgs,
        section: TrainerSection,
        loss_fn: LossFn,
        *,
        version: int = 0,
    ) -> None:
        self.model = model
        self.args = args
        self.section = section
        self.loss_fn = loss_fn
        self.params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
        self.optimizer, self.master = make_optimizer(self.params, section)
        self.version = version
        self.step = 0
        self.accumulated_batches = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ compute
    def _logprobs(self, batch: MicroBatch, loss_only: bool = False) -> torch.Tensor:
        if problem := batch_problem(batch, self.args.vocab_size):
            raise TrainerInputError(problem)
        return model_logprobs(self.model, batch.to(self.device), loss_only)

    def forward_backward(self, batch: MicroBatch) -> dict[str, float]:
        self.model.train()
        logprobs = self._logprobs(batch, loss_only=True)  # the loss reads its mask's tokens alone
        loss, metrics = self.loss_fn(logprobs, batch.to(self.device))
        if loss.dim() != 0:
            raise TrainerInputError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
        loss.backward()
        self.accumulated_batches += 1
        return {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    @torch.no_grad()
    def compute_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(batch).cpu()

    # ------------------------------------------------------------------ gradients
    def export_grads(self) -> dict[str, torch.Tensor]:
        return {
            name: (torch.zeros_like(p) if p.grad is None else p.grad).detach().to("cpu", copy=True)
            for name, p in self.params.items()
        }

    @torch.no_grad()
    def import_grads(self, grads: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(grads) - set(self.params))
        if unknown:
            raise TrainerInputError(f"import_grads: no parameter named {unknown[:5]} in this model")
        for name, grad in grads.items():
            param = self.params[name]
            if tuple(grad.shape) != tuple(param.shape):
                raise TrainerInputError(
                    f"import_grads: {name} has shape {tuple(grad.shape)}, parameter is {tuple(param.shape)}"
                )
            add_grad(param, grad)

    def zero_grads(self) -> None:
        for param in self.params.values():  # (the optimizer's own may be float32 master copies)
            param.grad = None
        self.accumulated_batches = 0

    def optimizer_step(self, scale: float) -> dict[str, float]:
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TrainerInputError(f"optimizer_step scale must be a finite number, got {scale!r}")
        params = [p for p in self.params.values() if p.grad is not None]
        with torch.no_grad():
            for p in params:
                p.grad.mul_(scale)
        max_norm = self.section.grad_clip if self.section.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        return apply_step(self, grad_norm)

    # ------------------------------------------------------------------ weights and checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        dtype = next(self.model.parameters()).dtype
        with torch.no_grad():
            load_state_into(self.model, state, dtype=dtype)
        self.params = dict(self.model.named_parameters())
        if self.master is not None:
            self.master.reload(self.params)
        self.version = version

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        save_hf(self.model, self.args, folder)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "version": self.version,
            "rng": _rng_state(),
        }
        if self.master is not None:
            state["master"] = self.master.state()
        torch.save(state, folder / STATE_FILE)
        return folder

    def load(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / STATE_FILE).is_file():
            raise FileNotFoundError(f"no {STATE_FILE} in {folder}: not a trainer checkpoint")
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
        self.load_state_dict(read_hf_weights(folder), version=int(state["version"]))
        self.optimizer.load_state_dict(state["optimizer"])
        set_hyperparameters(self.optimizer, self.section)
        if self.master is not None and "master" in state:
            self.master.load(state["master"])
        self.step = int(state["step"])
        _set_rng_state(state["rng"])
        self.zero_grads()


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
