"""Config section `transfer`: which backend moves weights, gradients and KV state, and each backend's options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section

Backend = Literal["object_store", "mooncake", "collective"]


class MooncakeOptions(Section):
    """Mooncake transfer engine: TCP on CPU machines, RDMA on clusters (the same code)."""

    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transport protocol.")
    device_name: str = Field("", description="RDMA NIC(s), e.g. 'mlx5_0' (empty for TCP).")
    hostname: str = Field("127.0.0.1", description="Address this process is reached at by its peers.")
    metadata_server: str = Field(
        "P2PHANDSHAKE", description="Mooncake metadata service; P2PHANDSHAKE needs none (peers handshake)."
    )
    chunk_bytes: int = Field(
        64 << 20,
        ge=1 << 16,
        description="Largest piece of one read; a transfer is read in such pieces at once.",
    )
    staging_buffers: int = Field(
        2,
        ge=1,
        description="Registered send buffers reused round-robin across versions (2: version v stays "
        "readable while v+1 is staged).",
    )
    receive_buffers: int = Field(
        2,
        ge=0,
        description="Registered, pre-touched receive buffers reused across fetches (each once nothing "
        "returned from its last fetch is alive); 0: a fresh buffer per fetch.",
    )


class CollectiveOptions(Section):
    """ray.util.collective: gloo on CPU, NCCL (cupy) on GPU (the same code); one group per transfer."""

    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="Collective backend: gloo (CPU tensors) or nccl (GPU buffers, cupy's NCCL)."
    )
    group_name: str = Field(
        "gyre-transfer",
        description="Prefix of the names of the NCCL groups formed per transfer (a gloo group is the "
        "process' default torch.distributed group for the time of one transfer).",
    )


class TransferSection(Section):
    """What moves between cells, and how."""

    weights: Backend = Field(
        "object_store",
        description="Backend publishing the core's weights to cells (collective: broadcast to the cells "
        "there at publish time; a cell that missed it fetches through the object store).",
    )
    gradients: Backend = Field(
        "object_store",
        description="Backend carrying satellites' gradients to the core (collective: point to point).",
    )
    kv: Literal["object_store", "mooncake"] = Field(
        "object_store",
        description="Backend moving a request's or a waiting session's KV state between cells.",
    )
    migrate_sessions: bool = Field(
        True,
        description="When a cell drains, move the cached prompt prefix of each session it served (agents "
        "waiting between calls) to the cell its next call goes to; off: that call re-prefills its prompt.",
    )
    verify_checksums: bool = Field(
        False, description="CRC-32 every tensor on both ends and fail a transfer whose bytes differ."
    )
    timeout_s: float = Field(120.0, gt=0, description="Longest a single transfer may take before it fails.")
    receive_buffers: int = Field(
        2,
        ge=0,
        description="Object store: pooled, pre-touched buffers a receiver copies fetched bytes into, each "
        "reused once nothing returned from its last fetch is alive; 0: fresh memory per fetch.",
    )
    mooncake: MooncakeOptions = Field(default_factory=MooncakeOptions, description="Mooncake options.")
    collective: CollectiveOptions = Field(
        default_factory=CollectiveOptions, description="Collective options."
    )
