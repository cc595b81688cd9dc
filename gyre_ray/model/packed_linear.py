"""Inference copies of the model's projection weights, fused and packed for the CPU GEMM (float32).

A decode step multiplies a few rows (one per running request) by every weight matrix; with torch's
default `F.linear` that shape runs well under the rate the same GEMM reaches once its weight is
packed ahead of time into the kernel's own layout (measured in `benchmarks/bench_vs_hf.py`'s
profile, docs/engine.md). `pack_inference_weights(model)` builds, next to the parameters, one packed
copy per group of projections that read the same input: q/k/v (one GEMM instead of three),
gate/up (one instead of two), o, down and the LM head. The model uses them only when no gradient
is being recorded, so the trainer's autograd path never sees them.

Three packings exist: gyre-ray's own AVX2 kernel (`native_gemm`, built with the system C compiler),
MKL's packed-B sgemm (`torch.ops.mkl._mkl_linear`) and oneDNN's blocked layout
(`torch.ops.mkldnn._linear_pointwise`). Each group takes the fastest of those available at
`rows_hint` rows on one thread, raced once per weight shape in a process: which wins depends on the
CPU (on this project's 2-core AVX2 machine the native kernel runs the `m61` shapes at 1.3-1.7x the
better of MKL and oneDNN at 2-16 rows and 1.03x at 1,024; `benchmarks/bench_gemm.py`). The
native kernel runs on one thread, so while torch is set to several intra-op threads a native
packing leaves the call to `F.linear` (MKL on all of them). An MKL packing made for `rows_hint` rows
has the same size and gives the same products at any row count (its speed is tuned for the hint),
but torch's op only takes its packed path when the rows equal the count it is told, so each call
passes its own row count. Every packing is checked once against `F.linear` at another row count and
gives way to the next fastest if it disagrees (a miscompiled kernel, an MKL whose packing did depend
on the rows).

The copies follow the parameters: each `PackedLinear` is built on first use and remembers the
identity, storage and in-place version counter of its source weights; it rebuilds itself when any
of them moved (`load_state_dict`, an optimizer step on a shared model, `param.data = ...`, a new
parameter object), so a forward never reads stale weights.
`unpack_inference_weights(model)` drops them (the engine does this when it frees its weights).
Anything but a float32 CPU weight with oneDNN available keeps plain `F.linear`. Under the MKL or
oneDNN packing so does a call with a single row (a lone request's decode step), where MKL's unpacked
kernel is faster still, and, under the MKL packing, a call with more rows than the packing was made
for (`rows_hint`: a prefill), where that packing is slower than the unpacked kernel (1.25x at 1,024
rows when packed for 16). The native kernel takes every row count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gyre_ray.model import native_gemm

_ONEDNN = torch.ops.mkldnn
_MKL = torch.ops.mkl
_PROBE_ROWS = (3, 5)  # rows of the one-time check of a packing: the first that is not the hint


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether this weight can be packed: a float32 CPU tensor with torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(_ONEDNN, "_reorder_linear_weight")
        and hasattr(_ONEDNN, "_linear_pointwise")
    )


def _mkl_supported() -> bool:
    return (
        torch.backends.mkl.is_available()
        and hasattr(_MKL, "_mkl_reorder_linear_weight")
        and hasattr(_MKL, "_mkl_linear")
    )


def _native_available() -> bool:
    return native_gemm.library() is not None


# (N, K, rows_hint) -> the packing kinds, fastest first: raced once per process
_RANKED: dict[tuple[int, int, int], list[str]] = {}


def _seconds_per_call(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    gemm(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        gemm(x)
        gemm(x)
        best = min(best, (time.perf_counter() - start) / 2)
    return best


class PackedLinear:
    """`x @ cat(weights).T` through one packed GEMM over a copy of the `layers`' weights."""

    def __init__(self, layers: Sequence[nn.Linear], rows_hint: int) -> None:
        self.layers = list(layers)  # read at each call: a replaced parameter is seen too
        self.rows_hint = max(1, rows_hint)
        self.splits = [layer.weight.size(0) for layer in self.layers]
        self._signature: tuple[tuple[int, int, int], ...] | None = None
        self._packed: torch.Tensor | None = None
        self.kind: str | None = None  # "native", "mkl" or "onednn" once packed
        self._mkl_shape: torch.Tensor | None = None  # (N, K) stride-0 stand-in: MKL's op reads sizes only

    def _current(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((id(w), w.data_ptr(), w._version) for w in (layer.weight for layer in self.layers))

    def _pack(self, kind: str, merged: torch.Tensor) -> None:
        self.kind, self._mkl_shape = kind, None
        if kind == "native":
            self._packed = native_gemm.pack(merged)
        elif kind == "mkl":
            self._packed = _MKL._mkl_reorder_linear_weight(merged, self.rows_hint)
            self._mkl_shape = merged.new_zeros(1).expand(merged.shape)
        else:
            self._packed = _ONEDNN._reorder_linear_weight(merged, self.rows_hint)

    def _race(self, kinds: list[str], merged: torch.Tensor) -> list[str]:
        """`kinds` fastest first at `rows_hint` rows on one thread, timed once per weight shape (which
        wins depends on the CPU: the native kernel's AVX2 code may lose to MKL with AVX-512)."""
        key = (*merged.shape, self.rows_hint)
        if key not in _RANKED:
            x = torch.randn(self.rows_hint, merged.size(1), generator=torch.Generator().manual_seed(1))
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                seconds = {}
                for kind in kinds:
                    self._pack(kind, merged)
                    seconds[kind] = _seconds_per_call(self._gemm, x)
                    self._packed, self._mkl_shape = None, None
            finally:
                torch.set_num_threads(threads)
            _RANKED[key] = sorted(kinds, key=seconds.__getitem__)
        return [kind for kind in _RANKED[key] if kind in kinds]

    def _refresh(self) -> None:
        self._packed, self._mkl_shape, self.kind = None, None, None  # free the old copy first
        kinds = [k for k, ok in (("native", _native_available()), ("mkl", _mkl_supported())) if ok]
        with torch.no_grad():
            weights = [layer.weight.detach() for layer in self.layers]
            merged = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
            kinds = self._race([*kinds, "onednn"], merged) if kinds else ["onednn"]
            rows = next(n for n in _PROBE_ROWS if n != self.rows_hint)
            probe = torch.randn(rows, merged.size(1), generator=torch.Generator().manual_seed(0))
            for kind in kinds:  # oneDNN, always among them, is taken unchecked as before
                self._pack(kind, merged)
                if kind == "onednn" or torch.allclose(
                    self._gemm(probe), F.linear(probe, merged), rtol=1e-4, atol=1e-5
                ):
                    break
        self._signature = self._current()

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "native":
            return native_gemm.gemm(x, self._packed, sum(self.splits))
        if self.kind == "mkl":
            return _MKL._mkl_linear(x, self._packed, self._mkl_shape, None, x.numel() // x.size(-1))
        return _ONEDNN._linear_pointwise(x, self._packed, None, "none", [], "")

    def _unpacked(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through plain `F.linear` on the parameters: under the native packing, when
        torch runs on several threads; under MKL's or oneDNN's, a single row (a lone decode, where MKL's
        unpacked kernel is faster), or more rows than an MKL packing was made for (a prefill, where the
        packing made for a few rows is slower than the unpacked kernel)."""
        if self._packed is None or self._current() != self._signature:
            self._refresh()  # first use, or the parameters changed in place or were replaced
        if self.kind == "native":
            return torch.get_num_threads() != 1
        rows = x.numel() // x.size(-1)
        return rows == 1 or (self.kind == "mkl" and rows > self.rows_hint)

    def _plain(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, layer.weight) for layer in self.layers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._unpacked(x):
            outputs = self._plain(x)
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
        return self._gemm(x)

    def free(self) -> None:
        self._packed, self._mkl_shape, self._signature, self.kind = None, None, None, None

    def __getstate__(self) -> dict:
        """Copies and pickles carry no packed tensor; the copy packs its own weights on first use."""
        return {**self.__dict__, "_packed": None, "_mkl_shape": None, "_signature": None, "kind": None}

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One output per source weight (the packed GEMM's output cut back into them)."""
        if self._unpacked(x):
            return self._plain(x)
        return self._gemm(x).split(self.splits, dim=-1)


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
