"""Collectives backend through `ray.util.collective`: gloo on CPU, NCCL (cupy) on GPU, the same code.

Cells come and go (drained, restarted after a fault), so there is no long-lived group: every transfer
forms a group of its own over the processes present at that moment, runs one collective, and tears
the group down. Each end lives in a Ray actor that exposes `CollectiveHost`'s calls and knows its own
actor name and its peers' (`connect`).

- **weights** (a ticket of kind "weights"): the sender's `push` asks every peer whether it is there
  (`collective_ready`, a few seconds at most), forms a group of itself (rank 0) and those that
  answered, and broadcasts the flat buffer; each member keeps the last version it received from that
  sender, and its `fetch` of the ticket returns it without moving a byte again.
- **gradients** (any other kind): the receiver's `fetch` forms a group of two with the sender
  (`collective_join` on the sender's actor), which sends its staged buffer point to point.
- **fallback**: a receiver that missed the broadcast (not there yet, restarted since, or the
  collective failed) asks the sender to stage the kept buffer through the Ray object store
  (`transfer_fallback`) and fetches it from there; the reason is logged and counted in `stats`.

A process holds one torch.distributed default group at a time (Ray's gloo groups are built on it), so
the transfers of one process run one at a time (a process-wide lock), and gloo refuses a process that
already has a default group of its own (an in-process Megatron trainer). The gloo rendezvous is a
`TCPStore` that rank 0 serves on a free port; the group's timeout is `transfer.timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from gyre_ray.transfer.base import Ticket, TransferError, Transport, register_transport
from gyre_ray.transfer.layout import plan, read_from, write_into
from gyre_ray.transfer.object_store import ObjectStoreTransport

log = logging.getLogger(__name__)

_PROCESS_LOCK = threading.Lock()  # one torch.distributed default group per process: one transfer at a time
_OURS = threading.Event()  # set while this process' default group is one a transfer made
READY_S = 5.0  # how long a peer may take to say it is there before a broadcast goes on without it
CANNOT_JOIN = "cannot join (not connected, or its process has a torch.distributed group)"


@register_transport
class CollectiveTransport(Transport):
    """One short-lived collective group per transfer; a missed broadcast falls back to the object store."""

    name = "collective"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.actor: str | None = None  # this end's Ray actor name
        self.namespace: str | None = None
        self.peers: list[str] = []  # actor names a broadcast goes to
        self._staged: dict[int, tuple[torch.Tensor, Ticket]] = {}
        self._received: dict[str, tuple[int, torch.Tensor]] = {}  # sender -> its last broadcast (seq, bytes)
        self._seq = itertools.count(1)
        # the fallback's own transport, kept: its receive pool's buffers are reused fetch after fetch
        self._object_store = ObjectStoreTransport(self.section, self.owner)
        self.stats: dict[str, Any] = {
            "collective": 0,
            "fallback": 0,
            "last_fallback": None,
            "last_push": None,
        }

    @property
    def backend(self) -> str:
        return self.section.collective.backend

    def can_join(self) -> bool:
        """Whether this end can take part in a transfer: it is connected, and (gloo) no default
        torch.distributed group of someone else's holds the process."""
        foreign = self.backend == "gloo" and dist.is_initialized() and not _OURS.is_set()
        return self.actor is not None and not foreign

    def connect(self, actor: str, namespace: str | None, peers: list[str]) -> None:
        """Where this end lives (its actor's name) and the actors its broadcasts go to."""
        self.actor, self.namespace = actor, namespace
        self.peers = [p for p in peers if p != actor]

    # ------------------------------------------------------------------ sender
    def stage(self, payload: Any, *, kind: str, version: int | None = None, **_: Any) -> Ticket:
        if self.actor is None:
            raise TransferError(
                f"{self.owner}: the collective transport runs in a named Ray actor (connect first)"
            )
        layout, tensors = plan(payload)
        buffer = self._buffer(layout.nbytes)
        write_into(buffer, layout, tensors)
        seq = next(self._seq)
        mode = "broadcast" if kind == "weights" else "pull"
        address = {"actor": self.actor, "namespace": self.namespace, "seq": seq, "mode": mode}
        ticket = Ticket(self.name, kind, self.owner, layout, version, self._checksums(tensors), address)
        self._staged[seq] = (buffer, ticket)
        return ticket

    def push(self, ticket: Ticket) -> dict[str, Any]:
        """Broadcast a staged weight ticket to every peer that is there; returns who got it and who not."""
        if ticket.address["mode"] != "broadcast":
            return {}
        started = time.perf_counter()
        members, missed = self._ready_peers()
        got: list[str] = []
        if members:
            buffer, _ = self._staged[ticket.address["seq"]]
            op = {"mode": "broadcast", "world": len(members) + 1, "sender": self.owner,
                  "seq": ticket.address["seq"], "nbytes": ticket.nbytes, "what": ticket.describe()}  # fmt: skip
            others = {name: (handle, rank) for rank, (name, handle) in enumerate(members, 1)}
            refs, failed = self._run_with(op, buffer, 0, others)
            if failed is not None:
                log.warning("%s: broadcast of %s failed here: %s", self.owner, ticket.describe(), failed)
            for name, _ in members:
                if name not in refs:
                    missed[name] = str(failed)
            if refs:
                ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.section.timeout_s)
            for name, ref in refs.items():
                try:
                    ray.get(ref, timeout=0)
                    got.append(name)
                except Exception as exc:
                    missed[name] = _reason(exc)
        for name, reason in missed.items():
            log.warning("%s: %s did not reach %s (%s); it will fetch it through the object store",
                        self.owner, ticket.describe(), name, reason)  # fmt: skip
        self.stats["last_push"] = summary = {
            "version": ticket.version, "received": got, "missed": missed,
            "seconds": round(time.perf_counter() - started, 4),
        }  # fmt: skip
        return summary

    def fallback(self, seq: int) -> Ticket:
        """The staged payload `seq` again, staged through the object store (for a receiver that missed it)."""
        if seq not in self._staged:
            raise TransferError(f"{self.owner}: staged payload #{seq} was released")
        buffer, ticket = self._staged[seq]
        if ticket.address["mode"] != "broadcast":  # a pulled payload (gradients): the object store has it
            self._staged.pop(seq)  # now (a copy), and nothing else releases it: it would stay for good
        return self._object_store.restage(buffer, ticket)

    def release(self, ticket: Ticket) -> None:
        self._staged.pop(ticket.address.get("seq"), None)

    # ------------------------------------------------------------------ receiver
    def fetch(self, ticket: Ticket) -> Any:
        address = ticket.address
        if address["mode"] == "broadcast":
            seq, buffer = self._received.get(ticket.sender, (None, None))
            if seq == address["seq"]:
                return self._read(ticket, buffer)
            return self._fallback(ticket, "not received by broadcast")
        handle = self._handle(ticket)
        try:
            ready = ray.get(handle.collective_ready.remote(), timeout=min(READY_S, self.section.timeout_s))
        except Exception as exc:
            return self._fallback(ticket, _reason(exc), handle)
        if not ready:  # (a sender that cannot join would leave this end waiting out the rendezvous)
            return self._fallback(ticket, f"{ticket.sender} {CANNOT_JOIN}", handle)
        buffer = self._buffer(ticket.nbytes)
        op = {"mode": "send", "world": 2, "sender": ticket.sender, "seq": address["seq"], "nbytes": ticket.nbytes,
              "what": ticket.describe()}  # fmt: skip
        try:
            refs, failed = self._run_with(op, buffer, 0, {ticket.sender: (handle, 1)})
            if failed is not None:
                raise failed
            ray.get(refs[ticket.sender], timeout=self.section.timeout_s)
        except Exception as exc:
            return self._fallback(ticket, _reason(exc), handle)
        return self._read(ticket, buffer)

    def join_op(self, op: dict[str, Any]) -> dict[str, Any]:
        """This end's part of a transfer another end started: receive a broadcast, or send a staged payload."""
        if op["mode"] == "broadcast":
            buffer = self._buffer(op["nbytes"])
            self._run(op, buffer, op["rank"])
            self._received[op["sender"]] = (op["seq"], buffer)
        else:
            if op["seq"] not in self._staged:
                raise TransferError(f"{self.owner}: staged payload #{op['seq']} was released")
            self._run(op, self._staged[op["seq"]][0], op["rank"])
            self._staged.pop(op["seq"], None)  # delivered: the receiver holds it now
        return {"rank": op["rank"]}

    def close(self) -> None:
        self._staged.clear()
        self._received.clear()

    # ------------------------------------------------------------------ internals
    def _buffer(self, nbytes: int) -> torch.Tensor:
        device = "cuda" if self.backend == "nccl" else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise TransferError(f"{self.owner}: transfer.collective.backend=nccl needs a CUDA GPU")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _read(self, ticket: Ticket, buffer: torch.Tensor) -> Any:
        buffer = buffer.cpu()  # NCCL's buffer lives on the GPU; payloads are CPU tensors
        self._verify(ticket, buffer)
        self.stats["collective"] += 1
        return read_from(buffer, ticket.layout, copy=False)

    def _handle(self, ticket: Ticket) -> Any:
        try:
            return ray.get_actor(ticket.address["actor"], namespace=ticket.address["namespace"])
        except ValueError:
            raise self.error(ticket, f"sender actor {ticket.address['actor']!r} is gone") from None

    def _fallback(self, ticket: Ticket, reason: str, handle: Any = None) -> Any:
        log.warning("%s: %s through the object store instead (%s)", self.owner, ticket.describe(), reason)
        self.stats["fallback"] += 1
        self.stats["last_fallback"] = {"what": ticket.describe(), "reason": reason}
        try:
            handle = handle or self._handle(ticket)
            again = ray.get(
                handle.transfer_fallback.remote(ticket.address["seq"]), timeout=self.section.timeout_s
            )
        except TransferError:
            raise
        except Exception as exc:
            raise self.error(
                ticket, f"{reason}; the object-store fallback failed too: {_reason(exc)}"
            ) from None
        return self._object_store.fetch(again)

    def _ready_peers(self) -> tuple[list[tuple[str, Any]], dict[str, str]]:
        """The peers that answer `collective_ready` within READY_S, and why the others are left out."""
        asked: dict[str, Any] = {}
        missed: dict[str, str] = {}
        for name in self.peers:
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
                asked[name] = (handle, handle.collective_ready.remote())
            except ValueError:
                missed[name] = "no such actor (dead, not restarted yet)"
        refs = [ref for _, ref in asked.values()]
        ray.wait(refs, num_returns=len(refs), timeout=min(READY_S, self.section.timeout_s))
        members = []
        for name, (handle, ref) in asked.items():
            try:
                if ray.get(ref, timeout=0):
                    members.append((name, handle))
                else:
                    missed[name] = CANNOT_JOIN
            except ray.exceptions.GetTimeoutError:
                missed[name] = f"no answer within {READY_S:g} s"
            except Exception as exc:
                missed[name] = _reason(exc)
        return members, missed

    def _run_with(
        self, op: dict[str, Any], buffer: torch.Tensor, rank: int, others: dict[str, tuple[Any, int]]
    ) -> tuple[dict[str, Any], TransferError | None]:
        """Start the group's other members (`collective_join` on their actors) and run this end's part;
        returns their calls' refs and this end's own failure (None when its part went through)."""
        with _PROCESS_LOCK:
            if not self.can_join():
                return {}, self._foreign_group()
            store = None
            if self.backend == "gloo":
                store = dist.TCPStore(
                    ray.util.get_node_ip_address(), 0, op["world"], is_master=True,
                    timeout=self._timeout(), wait_for_workers=False,
                )  # fmt: skip
                op = {**op, "master": (store.host, store.port)}
            else:
                op = {**op, "group": f"{self.section.collective.group_name}-{secrets.token_hex(4)}"}
            refs = {
                name: handle.collective_join.remote({**op, "rank": r}) for name, (handle, r) in others.items()
            }
            try:
                self._run(op, buffer, rank, store, locked=True)
            except TransferError as exc:
                return refs, exc
        return refs, None

    def _run(
        self, op: dict[str, Any], buffer: torch.Tensor, rank: int, store: Any = None, locked: bool = False
    ) -> None:
        """Form the group `op` describes as `rank`, run its one collective on `buffer`, tear it down."""
        if not locked:
            with _PROCESS_LOCK:
                return self._run(op, buffer, rank, store, locked=True)
        import ray.util.collective as col

        world, gloo = op["world"], self.backend == "gloo"
        name = "default" if gloo else op["group"]  # gloo: Ray's group is the default group made here
        try:
            if gloo:
                if dist.is_initialized():
                    raise self._foreign_group()
                _OURS.set()
                if store is None:
                    host, port = op["master"]
                    store = dist.TCPStore(host, port, world, is_master=False, timeout=self._timeout())
                dist.init_process_group(
                    "gloo", store=store, world_size=world, rank=rank, timeout=self._timeout()
                )
            col.init_collective_group(world, rank, backend=self.backend, group_name=name,
                                      gloo_timeout=int(self.section.timeout_s * 1000))  # fmt: skip
            if op["mode"] == "broadcast":
                col.broadcast(buffer, src_rank=0, group_name=name)
            elif rank == 0:
                col.recv(buffer, src_rank=1, group_name=name)
            else:
                col.send(buffer, dst_rank=0, group_name=name)
        except TransferError:
            raise
        except Exception as exc:  # gloo/NCCL errors (peer gone, timeout) surface as RuntimeError
            raise TransferError(
                f"{self.owner}: collective {op['mode']} of {op['what']} failed: {_reason(exc)}"
            ) from None
        finally:
            if col.is_group_initialized(name):
                col.destroy_collective_group(name)
            if gloo and _OURS.is_set():
                if dist.is_initialized():
                    dist.destroy_process_group()
                _OURS.clear()

    def _foreign_group(self) -> TransferError:
        return TransferError(
            f"{self.owner}: this process already has a torch.distributed group of its own (an in-process "
            "Megatron trainer?); the gloo collective transport needs the process' default group: use "
            "object_store or mooncake"
        )

    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.section.timeout_s)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class CollectiveHost:
    """The calls a peer makes to a Ray actor holding a `CollectiveTransport` (mix into the actor's class)."""

    def _collective(self) -> CollectiveTransport:
        raise NotImplementedError

    async def collective_ready(self) -> bool:
        """True when this actor can take part in a transfer now."""
        return self._collective().can_join()

    async def collective_join(self, op: dict[str, Any]) -> dict[str, Any]:
        """This end's part of a transfer another end started (see `CollectiveTransport.join_op`)."""
        return await asyncio.to_thread(self._collective().join_op, op)

    async def transfer_fallback(self, seq: int) -> Ticket:
        """A payload this end staged, again through the object store (see `CollectiveTransport.fallback`)."""
        return await asyncio.to_thread(self._collective().fallback, seq)
