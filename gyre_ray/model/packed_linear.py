"""Inference copies of the model's projection weights, fused and in oneDNN's blocked layout (CPU, float32).

A decode step multiplies a few rows (one per running request) by every weight matrix; with torch's
default `F.linear` (MKL) that shape runs at about two thirds of the rate oneDNN reaches on the same
weights once they are reordered into its blocked layout (measured in `benchmarks/bench_vs_hf.py`'s
profile, docs/engine.md). `pack_inference_weights(model)` builds, next to the parameters, one
reordered copy per group of projections that read the same input: q/k/v (one GEMM instead of
three), gate/up (one instead of two), o, down and the LM head. The model uses them only when no
gradient is being recorded, so the trainer's autograd path never sees them.

The copies follow the parameters: each `PackedLinear` is built on first use and remembers the
identity, storage and in-place version counter of its source weights; it rebuilds itself when any
of them moved (`load_state_dict`, an optimizer step on a shared model, `param.data = ...`, a new
parameter object), so a forward never reads stale weights.
`unpack_inference_weights(model)` drops them (the engine does this when it frees its weights).
Anything but a float32 CPU weight with oneDNN available keeps plain `F.linear`, and so does a call
with a single row (a lone request's decode step), where MKL beats oneDNN by ~8% (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

_OPS = torch.ops.mkldnn


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run this weight: a float32 CPU tensor with torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(_OPS, "_reorder_linear_weight")
        and hasattr(_OPS, "_linear_pointwise")
    )


class PackedLinear:
    """`x @ cat(weights).T` through one oneDNN GEMM over a reordered copy of the `layers`' weights."""

    def __init__(self, layers: Sequence[nn.Linear], rows_hint: int) -> None:
        self.layers = list(layers)  # read at each call: a replaced parameter is seen too
        self.rows_hint = max(1, rows_hint)
        self.splits = [layer.weight.size(0) for layer in self.layers]
        self._signature: tuple[tuple[int, int, int], ...] | None = None
        self._packed: torch.Tensor | None = None

    def _current(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((id(w), w.data_ptr(), w._version) for w in (layer.weight for layer in self.layers))

    def _refresh(self) -> None:
        self._packed = None  # free the old copy before building the new one
        with torch.no_grad():
            weights = [layer.weight.detach() for layer in self.layers]
            merged = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
            self._packed = _OPS._reorder_linear_weight(merged, self.rows_hint)
        self._signature = self._current()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.size(-1):  # one row (a lone decode): MKL's F.linear is faster there
            weights = [layer.weight for layer in self.layers]
            return (
                F.linear(x, weights[0])
                if len(weights) == 1
                else torch.cat([F.linear(x, w) for w in weights], -1)
            )
        if self._packed is None or self._current() != self._signature:
            self._refresh()  # first use, or the parameters changed in place or were replaced
        return _OPS._linear_pointwise(x, self._packed, None, "none", [], "")

    def free(self) -> None:
        self._packed, self._signature = None, None

    def __getstate__(self) -> dict:
        """Copies and pickles carry no oneDNN tensor; the copy packs its own weights on first use."""
        return {**self.__dict__, "_packed": None, "_signature": None}

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The GEMM's output cut back into one tensor per source weight."""
        return self(x).split(self.splits, dim=-1)


def packed(module: nn.Module, name: str) -> PackedLinear | None:
    """The module's packed projection `name`, when one exists and no gradient is being recorded."""
    fused = getattr(module, "_packed", None)
    if fused is None or torch.is_grad_enabled():
        return None
    return fused.get(name)


def pack_inference_weights(model: nn.Module, rows_hint: int = 16) -> bool:
    """Give a `Qwen3ForCausalLM` packed inference weights; False (nothing changed) where unsupported.

    `rows_hint`: the usual number of rows per call (the decode batch); any row count works.
    """
    if not packing_supported(model.lm_head.weight):
        unpack_inference_weights(model)
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn._packed = {
            "qkv": PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], rows_hint),
            "o": PackedLinear([attn.o_proj], rows_hint),
        }
        mlp._packed = {
            "gate_up": PackedLinear([mlp.gate_proj, mlp.up_proj], rows_hint),
            "down": PackedLinear([mlp.down_proj], rows_hint),
        }
    model._packed = {"lm_head": PackedLinear([model.lm_head], rows_hint)}
    return True


def unpack_inference_weights(model: nn.Module) -> None:
    """Drop the packed projections for good; the model falls back to `F.linear`."""
    for module in model.modules():
        if getattr(module, "_packed", None) is not None:
            module._packed = None


def free_packed_copies(model: nn.Module) -> None:
    """Free the packed copies' memory; each is rebuilt from the parameters at its next use."""
    for module in model.modules():
        for fused in (getattr(module, "_packed", None) or {}).values():
            fused.free()


def linear(module: nn.Module, name: str, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, through the packed copy `name` of `module` when there is one."""
    fused = packed(module, name)
    return fused(x) if fused is not None else F.linear(x, layer.weight, layer.bias)
