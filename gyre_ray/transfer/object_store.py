"""Ray object store backend (the default): one flat buffer per payload, put once, fetched by reference.

Works wherever Ray runs (one node or many); the bytes go through plasma, so a receiver on the
same node maps them without a network copy and copies them once into its own memory. The ticket
holds the object's reference, so Ray keeps the bytes while any ticket (or a Ray object holding one)
is alive, and frees them after: the sender keeps nothing. The receiver copies out of plasma into one
of `transfer.receive_buffers` pooled buffers, touched once when made (copying into fresh memory
costs a page fault per page, and a slow huge-page compaction on a fragmented machine), reused once
no tensor of its last fetch is alive and no other fetch is filling it (a cell fetches in several
threads at once: the core imports two satellites' gradients together); when all are in use, a
fetch copies into a fresh one. Without a Ray cluster in this process (a cell run in-process, as
unit tests do) the bytes travel inside the ticket instead.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import ray
import torch

from gyre_ray.transfer.base import Ticket, Transport, register_transport
from gyre_ray.transfer.layout import ReusableBuffer, claim_idle, plan, read_from, write_into


@register_transport
class ObjectStoreTransport(Transport):
    """`stage` = `ray.put` of the flat bytes; `fetch` = `ray.get` (bounded by `transfer.timeout_s`)."""

    name = "object_store"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._pool = [ReusableBuffer(touch=True) for _ in range(self.section.receive_buffers)]
        self._pool_lock = threading.Lock()  # a cell's fetches run in threads, several at once

    def stage(self, payload: Any, *, kind: str, version: int | None = None, **_: Any) -> Ticket:
        layout, tensors = plan(payload)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        write_into(buffer, layout, tensors)
        return Ticket(
            self.name, kind, self.owner, layout, version, self._checksums(tensors), _address(buffer)
        )

    def restage(self, buffer: torch.Tensor, ticket: Ticket) -> Ticket:
        """`ticket`'s payload, whose flat bytes are `buffer`, staged here instead (another backend's
        fallback); sender, layout, version and checksums stay the ticket's."""
        return dataclasses.replace(ticket, backend=self.name, address=_address(buffer.cpu()))

    def fetch(self, ticket: Ticket) -> Any:
        if "inline" in ticket.address:
            buffer = ticket.address["inline"]
            self._verify(ticket, buffer)
            return read_from(buffer, ticket.layout, copy=True)
        (ref,) = ticket.address["ref"]
        try:
            array = ray.get(ref, timeout=self.section.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self.error(ticket, f"no data within {self.section.timeout_s:g} s") from None
        except ray.exceptions.RayError as exc:
            raise self.error(ticket, f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        slot = claim_idle(self._pool, self._pool_lock)
        try:
            whole = (
                torch.empty(ticket.nbytes, dtype=torch.uint8) if slot is None else slot.ensure(ticket.nbytes)
            )
            buffer = whole[: ticket.nbytes]
            buffer.numpy()[:] = array
            self._verify(ticket, buffer)
            return read_from(buffer, ticket.layout, copy=False)  # views: they keep the slot in use
        finally:
            if slot is not None:
                slot.busy = False


def _address(buffer: torch.Tensor) -> dict[str, Any]:
    """Where a staged flat buffer is: in plasma, or (no Ray in this process) inside the ticket."""
    return {"ref": [ray.put(buffer.numpy())]} if ray.is_initialized() else {"inline": buffer}
