"""The transport seam: stage a payload on the sender, fetch it on the receiver, through one backend.

A `Ticket` is small and picklable (it travels through Ray calls); the bytes travel through the
backend. Pull backends (Ray object store, Mooncake) need only `stage` and `fetch`; collectives
need the sender to `push` while the receivers `fetch` (a rendezvous). Every failure is a
`TransferError` that names the receiver, the sender, what moved and its version.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gyre_ray.transfer.config import TransferSection
from gyre_ray.transfer.layout import Layout, checksums, tensor_checksums


class TransferError(RuntimeError):
    """A transfer failed (peer gone, timeout, corrupted bytes); the message says who, what and which version."""


@dataclass(frozen=True)
class Ticket:
    """What a receiver needs to fetch one staged payload."""

    backend: str
    kind: str  # "weights", "grads" or "kv"
    sender: str  # the staging process' owner name, e.g. "cell-0"
    layout: Layout
    version: int | None = None
    checksums: tuple[int, ...] | None = None
    address: dict[str, Any] = field(default_factory=dict)  # backend-specific

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def describe(self) -> str:
        what = self.kind if self.version is None else f"{self.kind} v{self.version}"
        return f"{what} from {self.sender} ({self.nbytes / 2**20:.1f} MiB via {self.backend})"


class Transport(abc.ABC):
    """One process' end of a backend. `owner` names the process (a cell id) in errors."""

    name: ClassVar[str]

    def __init__(self, section: TransferSection, owner: str) -> None:
        self.section = section
        self.owner = owner

    @abc.abstractmethod
    def stage(self, payload: Any, *, kind: str, version: int | None = None) -> Ticket:
        """Make `payload` fetchable and return its ticket (the sender keeps what the backend needs)."""

    def push(self, ticket: Ticket) -> None:  # noqa: B027 - optional: only collectives need it
        """Send a staged payload to receivers that are fetching it (collectives); a no-op for pull backends."""

    @abc.abstractmethod
    def fetch(self, ticket: Ticket) -> Any:
        """The payload `ticket` names, rebuilt in this process (raises TransferError)."""

    def release(self, ticket: Ticket) -> None:  # noqa: B027 - optional
        """The sender may free what it kept for `ticket`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Free this end's buffers and connections."""

    # ------------------------------------------------------------------ helpers for backends
    def _checksums(self, tensors: list) -> tuple[int, ...] | None:
        return tensor_checksums(tensors) if self.section.verify_checksums else None

    def _verify(self, ticket: Ticket, buffer: Any) -> None:
        if ticket.checksums is None:
            return
        got = checksums(buffer, ticket.layout)
        bad = [i for i, (a, b) in enumerate(zip(got, ticket.checksums, strict=True)) if a != b]
        if bad:
            raise self.error(ticket, f"{len(bad)} tensor(s) arrived with different bytes (checksum)")

    def error(self, ticket: Ticket, reason: str) -> TransferError:
        return TransferError(f"{self.owner}: receiving {ticket.describe()} failed: {reason}")


_BACKENDS: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make a backend available to `make_transport` under `cls.name`."""
    _BACKENDS[cls.name] = cls
    return cls


def make_transport(backend: str, section: TransferSection | None = None, *, owner: str) -> Transport:
    """This process' end of `backend` ("object_store", "mooncake" or "collective")."""
    from gyre_ray.transfer import collective, mooncake, object_store  # noqa: F401 - register backends

    if backend not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; allowed: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[backend](section or TransferSection(), owner)
