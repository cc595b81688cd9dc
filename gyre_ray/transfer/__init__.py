"""What moves between cells: weights (core -> cells), gradients (satellites -> core), KV state (cell -> cell).

One seam, three backends chosen by the `transfer` config section:

    transport = make_transport(cfg.transfer.weights, cfg.transfer, owner="cell-0")
    ticket = transport.stage(payload, kind="weights", version=v)   # sender: small, picklable
    transport.push(ticket)                                          # sender: collectives only
    payload = other_transport.fetch(ticket)                         # receiver (another process)

`payload` is any structure of tensors (a state dict, a gradient dict, an engine's `KVState`).
`gyre_ray.transfer.weights` adds the weight-sync invariants on top (versions, no mixing, failure
keeps the old version).
"""

from gyre_ray.transfer.base import Ticket, TransferError, Transport, make_transport, register_transport

__all__ = ["Ticket", "TransferError", "Transport", "make_transport", "register_transport"]
