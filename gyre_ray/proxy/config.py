"""Config section `proxy`: the agent-facing HTTP API."""

from __future__ import annotations

from pydantic import Field

from gyre_ray.configbase import Section


class ProxySection(Section):
    """Proxy settings."""

    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the proxy listens on (0: any free port).")
    max_concurrent_per_execution: int = Field(8, ge=1, description="Concurrent model calls per execution.")
