"""Weight sync invariants, in one place: versions only move forward, an engine never mixes two versions,
and a failed transfer leaves the cell serving the version it had.

    publisher = WeightPublisher(transport)              # on the core
    ticket = publisher.publish(trainer.state_dict(), version)
    receiver = WeightReceiver(transport)                # on every cell
    receiver.receive(ticket, engine_load)               # engine_load(state_dict, version)

The whole state is fetched before anything is loaded, and `load` (the engine's update at a safe
point) applies it at once. A ticket for a version the cell already holds (or an older one) is a
no-op. The publisher keeps the last `keep` versions fetchable and releases older ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre_ray.transfer.base import Ticket, TransferError, Transport


class WeightPublisher:
    """The core's side: stages each new version; older tickets are released after `keep` versions."""

    def __init__(self, transport: Transport, keep: int = 2) -> None:
        self.transport = transport
        self.keep = keep
        self._live: list[Ticket] = []

    @property
    def last(self) -> Ticket | None:
        """The ticket of the newest version published (None before the first)."""
        return self._live[-1] if self._live else None

    def publish(self, state: dict[str, Any], version: int) -> Ticket:
        if self._live and self._live[-1].version is not None and version <= self._live[-1].version:
            raise ValueError(
                f"weights v{version} published after v{self._live[-1].version}: versions only move forward"
            )
        ticket = self.transport.stage(state, kind="weights", version=version)
        self._live.append(ticket)
        while len(self._live) > self.keep:
            self.transport.release(self._live.pop(0))
        return ticket


class WeightReceiver:
    """A cell's side: which version it holds, and the all-or-nothing load of a new one."""

    def __init__(self, transport: Transport, version: int | None = None) -> None:
        self.transport = transport
        self.version = version

    def receive(self, ticket: Ticket, load: Callable[[dict[str, Any], int], None]) -> int:
        """Fetch and load `ticket`'s weights; returns the version held afterwards.

        Raises TransferError (naming this cell and the version) when the fetch or the load fails;
        the version held, and the engine's weights, are then unchanged.
        """
        if ticket.kind != "weights" or ticket.version is None:
            raise TransferError(
                f"{self.transport.owner}: {ticket.describe()} is not a versioned weight ticket"
            )
        if self.version is not None and ticket.version <= self.version:
            return self.version
        state = self.transport.fetch(ticket)
        try:
            load(state, ticket.version)
        except Exception as exc:
            raise TransferError(
                f"{self.transport.owner}: loading weights v{ticket.version} failed ({exc}); "
                f"still serving v{self.version}"
            ) from exc
        self.version = ticket.version
        return self.version
