"""Ray object store backend (the default): one flat buffer per payload, put once, fetched by reference.

Works wherever Ray runs (one node or many); the bytes go through plasma, so a receiver on the
same node maps them without a network copy and copies them once into its own memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from gyre_ray.transfer.base import Ticket, Transport, register_transport
from gyre_ray.transfer.layout import plan, read_from, write_into


@register_transport
class ObjectStoreTransport(Transport):
    """`stage` = `ray.put` of the flat bytes; `fetch` = `ray.get` (bounded by `transfer.timeout_s`)."""

    name = "object_store"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._staged: dict[int, Any] = {}  # id(ticket address) -> ObjectRef kept alive until release

    def stage(self, payload: Any, *, kind: str, version: int | None = None, **_: Any) -> Ticket:
        layout, tensors = plan(payload)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        write_into(buffer, layout, tensors)
        ref = ray.put(buffer.numpy())
        ticket = Ticket(
            self.name, kind, self.owner, layout, version, self._checksums(tensors), {"ref": [ref]}
        )
        self._staged[id(ticket.address)] = ref
        return ticket

    def fetch(self, ticket: Ticket) -> Any:
        (ref,) = ticket.address["ref"]
        try:
            array = ray.get(ref, timeout=self.section.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self.error(ticket, f"no data within {self.section.timeout_s:g} s") from None
        except ray.exceptions.RayError as exc:
            raise self.error(ticket, f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        buffer = torch.from_numpy(np.array(array, copy=True))
        self._verify(ticket, buffer)
        return read_from(buffer, ticket.layout, copy=False)

    def release(self, ticket: Ticket) -> None:
        self._staged.pop(id(ticket.address), None)

    def close(self) -> None:
        self._staged.clear()
