"""Mooncake transfer engine backend: receivers read the sender's registered buffer (TCP here, RDMA on clusters).

Each process starts one `TransferEngine` (`transfer.mooncake`: protocol, NIC, metadata service;
P2PHANDSHAKE needs no metadata server: peers are named "host:rpc_port"). The sender keeps
`staging_buffers` registered buffers and reuses them round-robin across versions (reallocating
only when a payload outgrows one), so version v stays readable while v+1 is staged. A receiver
reads the payload in `chunk_bytes` pieces in one batch into one of `receive_buffers` registered,
pre-touched buffers (fresh memory would page-fault under the transfer: 0.55 against 1.48 GiB/s
measured on TCP loopback) and returns views into it, no second copy. A buffer is reused only once
no tensor viewing it is alive any more (its storage's use count, a torch internal); while all are in
use, a fetch reads into a one-off buffer instead. A read runs on a thread waited for
`transfer.timeout_s` at most: a sender that is alive but silent fails the fetch then, and the
buffer it was reading into is abandoned (the read may still write into it). Needs the `mooncake-transfer-engine` wheel (the
non-CUDA build on CPU machines, with Debian's libibverbs1).

KV states (`kind="kv"`: a drained cell stages one per waiting session) each get a buffer of their
own, kept until the sender releases the ticket.

Each staged buffer starts with a 64-byte header holding the stage's sequence number; the receiver
reads it with the payload and refuses bytes whose number differs from its ticket's (the buffer was
reused by a later stage), so a late reader fails loudly instead of mixing versions.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gyre_ray.transfer.base import Ticket, TransferError, Transport, register_transport
from gyre_ray.transfer.layout import ALIGN, ReusableBuffer, claim_idle, plan, read_from, write_into

HEADER = ALIGN  # bytes before the payload: int64 sequence number, then padding


def mooncake_available() -> tuple[bool, str]:
    """Whether the Mooncake transfer engine imports here, and why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing libibverbs
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


class _StuckRead(TransferError):
    """A read that did not finish within `transfer.timeout_s` (its receive buffer is abandoned)."""


class _Registered(ReusableBuffer):
    """A buffer registered with the engine (registered again when it must grow; `free` unregisters)."""

    def __init__(self, engine: Any, touch: bool = False) -> None:
        super().__init__(touch)
        self.engine = engine

    def _allocated(self) -> None:
        if self.engine.register_memory(self.buffer.data_ptr(), self.buffer.numel()) != 0:
            raise TransferError(f"mooncake: registering a {self.buffer.numel()}-byte buffer failed")

    def _released(self) -> None:
        self.engine.unregister_memory(self.buffer.data_ptr())


@register_transport
class MooncakeTransport(Transport):
    """`stage` copies into a registered buffer; `fetch` reads it over the transfer engine."""

    name = "mooncake"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._engine: Any = None
        self._send: list[_Registered] = []
        self._recv: list[_Registered] = []
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._held: dict[int, _Registered] = {}  # KV stages by sequence number, until released
        self._abandoned: list[_Registered] = []  # receive buffers of reads that timed out (kept alive)
        self._readers: list[threading.Thread] = []  # those reads' threads
        self._next = 0

    @property
    def engine(self) -> Any:
        if self._engine is None:
            ok, why = mooncake_available()
            if not ok:
                raise TransferError(f"{self.owner}: the Mooncake transfer engine cannot load ({why})")
            from mooncake.engine import TransferEngine

            opts = self.section.mooncake
            engine = TransferEngine()
            rc = engine.initialize(opts.hostname, opts.metadata_server, opts.protocol, opts.device_name)
            if rc != 0:
                raise TransferError(
                    f"{self.owner}: Mooncake initialize({opts.hostname}, {opts.protocol}) returned {rc}"
                )
            self._engine = engine
            self._send = [_Registered(engine) for _ in range(opts.staging_buffers)]
            self._recv = [_Registered(engine, touch=True) for _ in range(opts.receive_buffers)]
        return self._engine

    @property
    def session_id(self) -> str:
        return f"{self.section.mooncake.hostname}:{self.engine.get_rpc_port()}"

    def stage(self, payload: Any, *, kind: str, version: int | None = None, **_: Any) -> Ticket:
        """Weights and gradients go to the round-robin staging buffers; KV states (many at once, one
        per drained session) each to a buffer of their own, kept until `release(ticket)`."""
        layout, tensors = plan(payload)
        session = self.session_id
        with self._send_lock:  # stages may come from several threads: each its own number and buffer
            self._next += 1
            seq = self._next
            if kind == "kv":
                slot = self._held[seq] = _Registered(self.engine)
            else:
                slot = self._send[(seq - 1) % len(self._send)]
            buffer = slot.ensure(HEADER + layout.nbytes)
            buffer[:8].view(torch.int64)[0] = seq
            write_into(buffer[HEADER:], layout, tensors)
        address = {"peer": session, "addr": buffer.data_ptr(), "seq": seq}
        return Ticket(self.name, kind, self.owner, layout, version, self._checksums(tensors), address)

    def fetch(self, ticket: Ticket) -> Any:
        self.engine  # noqa: B018 - starts the transfer engine and its receive pool on first use
        slot, pooled = self._receive_slot()
        hung = False
        try:
            buffer = slot.ensure(HEADER + ticket.nbytes)
            try:
                self._read(ticket, buffer)
            except _StuckRead:
                hung = True
                raise
            seq = int(buffer[:8].view(torch.int64)[0])
            if seq != ticket.address["seq"]:
                raise self.error(
                    ticket, f"the sender's buffer now holds a later stage (#{seq}): ticket too old"
                )
            payload = buffer[HEADER : HEADER + ticket.nbytes]
            self._verify(ticket, payload)
            return read_from(payload, ticket.layout, copy=False)  # views: they keep the slot in use
        finally:
            if hung:  # the read may still write into this buffer: never reuse or free it
                self._abandon(slot, pooled)
            else:
                slot.busy = False
                if not pooled:
                    slot.free()  # only the registration: `buffer` lives on in the returned tensors

    def _abandon(self, slot: _Registered, pooled: bool) -> None:
        with self._recv_lock:
            self._abandoned.append(slot)
            if pooled:
                self._recv[self._recv.index(slot)] = _Registered(self.engine, touch=True)

    def _receive_slot(self) -> tuple[_Registered, bool]:
        """A pooled receive buffer no live tensor views (True), else a one-off one (False)."""
        slot = claim_idle(self._recv, self._recv_lock)
        if slot is not None:
            return slot, True
        slot = _Registered(self.engine)
        slot.busy = True
        return slot, False

    def _read(self, ticket: Ticket, buffer: torch.Tensor) -> None:
        """Read the staged bytes into `buffer` (on a thread, waited for `transfer.timeout_s` at most:
        past that `_StuckRead`, and the read may still write into `buffer` later)."""
        engine = self.engine
        chunk = self.section.mooncake.chunk_bytes
        total = HEADER + ticket.nbytes
        offsets = list(range(0, total, chunk))
        local = [buffer.data_ptr() + o for o in offsets]
        remote = [ticket.address["addr"] + o for o in offsets]
        lengths = [min(chunk, total - o) for o in offsets]
        if not offsets:
            return
        peer, result = ticket.address["peer"], []

        def read() -> None:
            result.append(engine.batch_transfer_sync_read(peer, local, remote, lengths))

        reader = threading.Thread(target=read, name="gyre-mooncake-read", daemon=True)
        reader.start()
        reader.join(self.section.timeout_s)
        if reader.is_alive():
            self._readers.append(reader)
            reason = f"no data from {peer} within {self.section.timeout_s:g} s (peer stuck?)"
            raise _StuckRead(self.error(ticket, reason).args[0])
        if result[0] != 0:
            raise self.error(ticket, f"Mooncake read from {peer} returned {result[0]} (peer gone?)")

    def release(self, ticket: Ticket) -> None:
        held = self._held.pop(ticket.address.get("seq"), None)
        if held is not None:
            held.free()

    def close(self) -> None:
        for slot in [*self._send, *self._recv, *self._held.values()]:
            slot.free()
        self._send, self._recv, self._held, self._engine = [], [], {}, None
