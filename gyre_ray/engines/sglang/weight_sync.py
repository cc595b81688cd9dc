"""The trainer's end of SGLang's weight-update group: broadcast a state dict to SGLang servers.

As slime does it: the trainer is rank 0 of one process group; server i's ranks start at
`1 + sum(tp of servers before i)`, world size `1 + sum(tp)`. `connect` asks every server to join
(`/init_weights_update_group`) while the trainer joins itself; `send` then, per bucket of tensors,
tells every server what is coming (`/update_weights_from_distributed`: names, dtypes, shapes) and
broadcasts the tensors meanwhile. NCCL on GPU, gloo on CPU (the protocol tests).

The group is built the way SGLang's server builds its side (`init_custom_process_group`): with
sglang installed that very function is used; without it, the same recipe (a TCP store at the
master address, prefixed by the group name), which the CPU fake server shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gyre_ray.engines.sglang.engine import SGLangEngine


@dataclass
class WeightGroup:
    """One process group handle and how to broadcast over it from rank 0."""

    handle: Any
    registered: bool  # a group torch.distributed knows (sglang's); else a raw backend object

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.registered:
            dist.broadcast(tensor, src=0, group=self.handle)
        else:
            self.handle.broadcast([tensor], dist.BroadcastOptions()).wait()


def open_group(
    address: str, port: int, rank: int, world_size: int, group_name: str, backend: str = "nccl",
    timeout_s: float = 300.0,
) -> WeightGroup:  # fmt: skip
    """Join `group_name` as `rank` (blocks until all `world_size` members have joined)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        init_custom_process_group = None
    if init_custom_process_group is not None:
        group = init_custom_process_group(
            backend=backend,
            init_method=f"tcp://{address}:{port}",
            world_size=world_size,
            rank=rank,
            group_name=group_name,
        )
        return WeightGroup(group, registered=True)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return WeightGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), registered=False)
    if backend == "nccl":
        return WeightGroup(dist.ProcessGroupNCCL(prefixed, rank, world_size), registered=False)
    raise ValueError(f"unknown weight-group backend {backend!r}; allowed: nccl, gloo")


def buckets(
    state_dict: dict[str, torch.Tensor], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The state dict in order, cut into lists of at most `bucket_bytes` (a bigger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class WeightBroadcaster:
    """Rank 0 of the weight-update group of `engines` (each with its tensor-parallel size)."""

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        master_address: str,
        master_port: int,
        group_name: str = "gyre-weights",
        backend: str = "nccl",
        device: str | torch.device = "cpu",
    ) -> None:
        self.engines = list(engines)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.device = torch.device(device)
        self.world_size = 1 + sum(engine.tp_size for engine in self.engines)
        self.group: WeightGroup | None = None

    async def connect(self) -> None:
        """Every server joins (HTTP, concurrently) while this process joins as rank 0."""
        offsets = [1 + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        joins = [
            engine.init_weights_group(
                self.master_address, self.master_port, offset, self.world_size, self.group_name, self.backend
            )
            for engine, offset in zip(self.engines, offsets, strict=True)
        ]
        own = asyncio.to_thread(
            open_group,
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.backend,
        )
        results = await asyncio.gather(own, *joins)
        self.group = results[0]

    async def send(
        self, state_dict: dict[str, torch.Tensor], version: int, bucket_bytes: int = 512 << 20
    ) -> int:
        """Broadcast `state_dict` (HF names) to every server at `version`; returns the buckets sent."""
        if self.group is None:
            raise RuntimeError("WeightBroadcaster.send before connect()")
        sent = 0
        for bucket in buckets(state_dict, bucket_bytes):
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            names = [name for name, _ in bucket]
            dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
            shapes = [list(t.shape) for t in tensors]
            receives = [
                engine.update_weights_from_distributed(names, dtypes, shapes, version, self.group_name)
                for engine in self.engines
            ]

            def push(tensors: list[torch.Tensor] = tensors) -> None:
                for tensor in tensors:
                    self.group.broadcast(tensor)

            await asyncio.gather(asyncio.to_thread(push), *receives)
            sent += 1
        return sent
