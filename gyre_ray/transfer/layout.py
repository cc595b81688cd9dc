"""Payloads as flat bytes: split any structure of tensors into a skeleton plus one contiguous buffer.

`plan(payload)` walks dicts, lists, tuples and dataclasses, replaces each tensor by a placeholder and
says where each tensor's bytes go end to end (each 64-byte aligned) in one uint8 buffer;
`write_into` lays them there; `read_from` rebuilds the structure from the layout and a buffer
holding those bytes (for example one that another process filled). Per-tensor CRC-32 checksums prove a transfer bit-exact.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies in the flat buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Slot:
    index: int  # position in Layout.specs


@dataclass(frozen=True)
class Layout:
    """A payload's skeleton (tensors replaced by slots) and the place of every tensor's bytes."""

    skeleton: Any
    specs: tuple[TensorSpec, ...]
    nbytes: int


def _walk(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _walk(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_walk(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _walk(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}
        return (type(obj), fields)
    return obj


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        if len(obj) == 2 and isinstance(obj[0], type) and dataclasses.is_dataclass(obj[0]):
            return obj[0](**{k: _rebuild(v, tensors) for k, v in obj[1].items()})
        return tuple(_rebuild(v, tensors) for v in obj)
    return obj


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def plan(payload: Any) -> tuple[Layout, list[torch.Tensor]]:
    """The payload's layout and its tensors (in slot order), without copying anything."""
    tensors: list[torch.Tensor] = []
    skeleton = _walk(payload, tensors)
    specs, offset = [], 0
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"transfer payloads are CPU tensors here; got one on {t.device}")
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(t.dtype, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return Layout(skeleton, tuple(specs), offset), tensors


def write_into(buffer: torch.Tensor, layout: Layout, tensors: list[torch.Tensor]) -> None:
    """Copy `tensors` into `buffer` (uint8, at least layout.nbytes) at their offsets."""
    for spec, t in zip(layout.specs, tensors, strict=True):
        if spec.nbytes:
            buffer[spec.offset : spec.offset + spec.nbytes].copy_(_bytes_view(t))


def read_from(buffer: torch.Tensor, layout: Layout, copy: bool = True) -> Any:
    """The payload whose bytes lie in `buffer` (copies unless `copy=False`, then views into it)."""
    tensors = []
    for spec in layout.specs:
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
        if copy:
            raw = raw.clone()
        t = raw.view(spec.dtype) if spec.nbytes else torch.empty(0, dtype=spec.dtype)
        tensors.append(t.reshape(spec.shape))
    return _rebuild(layout.skeleton, tensors)


def checksums(buffer: torch.Tensor, layout: Layout) -> tuple[int, ...]:
    """CRC-32 of every tensor's bytes in `buffer`."""
    data = buffer.numpy()
    return tuple(zlib.crc32(data[s.offset : s.offset + s.nbytes]) for s in layout.specs)


def tensor_checksums(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """CRC-32 of each tensor's bytes (the same figure `checksums` gives after a transfer)."""
    return tuple(zlib.crc32(_bytes_view(t).numpy()) for t in tensors)


def use_count(buffer: torch.Tensor) -> int | None:
    """How many tensors share `buffer`'s storage (None where this torch does not say)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return None if counter is None else int(counter(buffer.untyped_storage()._cdata))


class ReusableBuffer:
    """A uint8 receive/staging buffer that may be handed out again once no tensor returned from its
    last use still views it (its storage's use count is back to the count it had idle); where torch
    cannot say, it counts as viewed for good. `touch`: every page written once when it is allocated,
    so copies into it later do not fault. Subclasses hook `_allocated` / `_released` (registration).

    Between claiming a buffer and returning views of it a fetch holds `busy` (set under the pool's
    lock): until those views exist the use count alone says nothing, and two threads fetching at once
    would otherwise both take the buffer and read each other's bytes."""

    def __init__(self, touch: bool = False) -> None:
        self.touch = touch
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._idle_count: int | None = None
        self.busy = False  # a fetch is reading into it

    def in_use(self) -> bool:
        """A fetch is reading into it, or tensors returned by an earlier one still view it."""
        return self.busy or self.viewed()

    def ensure(self, nbytes: int) -> torch.Tensor:
        """The whole buffer, replaced by a new allocation first when it is smaller than `nbytes`."""
        if self.buffer.numel() < nbytes:
            self.free()
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            if self.touch:
                self.buffer.fill_(0)
            self._allocated()
            self._idle_count = use_count(self.buffer)
        return self.buffer

    def viewed(self) -> bool:
        """Tensors returned from an earlier use still view the buffer (False for an unallocated one)."""
        if not self.buffer.numel():
            return False
        count = use_count(self.buffer)
        return count is None or count != self._idle_count

    def free(self) -> None:
        """Let go of the buffer (tensors viewing it stay valid: this object just drops its reference)."""
        if self.buffer.numel():
            self._released()
            self.buffer = torch.empty(0, dtype=torch.uint8)

    def _allocated(self) -> None:
        """Called with each new allocation."""

    def _released(self) -> None:
        """Called before the buffer is let go."""


def claim_idle(pool: list[ReusableBuffer], lock: threading.Lock) -> ReusableBuffer | None:
    """The first buffer of `pool` not `in_use`, marked busy under `lock` (None when all are in use);
    the fetch that claimed it sets `busy` back to False once it has returned its views."""
    with lock:
        for slot in pool:
            if not slot.in_use():
                slot.busy = True
                return slot
    return None
