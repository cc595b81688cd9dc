"""Collectives backend through `ray.util.collective`: gloo on CPU, NCCL (cupy) on GPU, the same code.

Every cell actor joins one group (`join(world_size, rank)`; the core is rank 0). A payload staged
without `dst_rank` is broadcast: the sender `push`es while every other member `fetch`es (weights:
core -> all cells). A payload staged with `dst_rank` goes point to point (gradients: satellite ->
core). Both sides must make their call at the same time, which the caller arranges (Ray calls to
the sender and receivers issued together). Note: Ray's gloo group initialises the process'
default torch.distributed group, so a process that runs its own (Megatron) needs a separate one.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from gyre_ray.transfer.base import Ticket, TransferError, Transport, register_transport
from gyre_ray.transfer.layout import plan, read_from, write_into


@register_transport
class CollectiveTransport(Transport):
    """Broadcast / send-recv of one flat buffer per payload over a named collective group."""

    name = "collective"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.rank: int | None = None
        self._staged: dict[int, torch.Tensor] = {}
        self._seq = itertools.count()

    @property
    def group(self) -> str:
        return self.section.collective.group_name

    def join(self, world_size: int, rank: int) -> None:
        """Join the group as `rank` of `world_size` (every member calls this at the same time)."""
        import ray.util.collective as col

        backend = self.section.collective.backend
        if backend == "nccl" and not torch.cuda.is_available():
            raise TransferError(f"{self.owner}: transfer.collective.backend=nccl needs a CUDA GPU")
        col.init_collective_group(world_size, rank, backend=backend, group_name=self.group)
        self.rank = rank

    def _require_rank(self) -> int:
        if self.rank is None:
            raise TransferError(f"{self.owner}: not in collective group {self.group!r} (call join first)")
        return self.rank

    def stage(
        self, payload: Any, *, kind: str, version: int | None = None, dst_rank: int | None = None, **_: Any
    ) -> Ticket:
        rank = self._require_rank()
        layout, tensors = plan(payload)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        write_into(buffer, layout, tensors)
        seq = next(self._seq)
        self._staged[seq] = buffer
        address = {"group": self.group, "src_rank": rank, "dst_rank": dst_rank, "seq": seq}
        return Ticket(self.name, kind, self.owner, layout, version, self._checksums(tensors), address)

    def push(self, ticket: Ticket) -> None:
        import ray.util.collective as col

        buffer = self._staged.pop(ticket.address["seq"])
        dst = ticket.address["dst_rank"]
        if dst is None:
            col.broadcast(buffer, src_rank=ticket.address["src_rank"], group_name=self.group)
        else:
            col.send(buffer, dst_rank=dst, group_name=self.group)

    def fetch(self, ticket: Ticket) -> Any:
        import ray.util.collective as col

        self._require_rank()
        buffer = torch.empty(ticket.nbytes, dtype=torch.uint8)
        src = ticket.address["src_rank"]
        try:
            if ticket.address["dst_rank"] is None:
                col.broadcast(buffer, src_rank=src, group_name=self.group)
            else:
                col.recv(buffer, src_rank=src, group_name=self.group)
        except Exception as exc:  # gloo/NCCL errors (peer gone, timeout) surface as RuntimeError
            raise self.error(ticket, f"{type(exc).__name__}: {exc}") from None
        self._verify(ticket, buffer)
        return read_from(buffer, ticket.layout, copy=False)

    def release(self, ticket: Ticket) -> None:
        self._staged.pop(ticket.address.get("seq"), None)

    def close(self) -> None:
        import ray.util.collective as col

        self._staged.clear()
        if self.rank is not None:
            col.destroy_collective_group(self.group)
            self.rank = None
