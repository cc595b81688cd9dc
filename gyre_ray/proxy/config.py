"""Config section `proxy`: the agent-facing HTTP API, its limits and its trajectory store (cells: `cells`)."""

from __future__ import annotations

from pydantic import Field

from gyre_ray.configbase import Section


class ProxySection(Section):
    """Proxy settings."""

    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(
        8000, ge=0, le=65535, description="Port of Serve's HTTP proxy in front of the app (0: any free port)."
    )
    max_concurrent_per_execution: int = Field(8, ge=1, description="Concurrent model calls per execution.")
    max_waiting_per_execution: int = Field(
        32,
        ge=0,
        description="Calls of one execution that may wait for a slot at once (unread); one more is "
        "refused with a 429 at once, so no execution can make a replica hold and poll unbounded connections.",
    )
    queue_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a call waits for a free per-execution slot or a routable cell before a 429/503.",
    )
    retry_after_s: int = Field(
        1,
        ge=0,
        description="Retry-After (seconds) sent with every 429 and 503: both are retryable (no cell or slot free yet).",
    )
    num_replicas: int = Field(
        1, ge=1, description="Proxy (Serve) replicas; each reads the cells' own drain state (drain_poll_s)."
    )
    drain_poll_s: float = Field(
        0.05,
        gt=0,
        description="How often a replica re-reads every cell's drain state (a cell's own flag is the truth).",
    )
    stream_interval_s: float = Field(
        0.01,
        ge=0,
        description=(
            "Cells send a call's intermediate tokens at most this often (0: as generated); the first "
            "tokens and the end of a call are never held back. Fewer batches cost the proxy less CPU."
        ),
    )
    direct_ingress: bool = Field(
        True,
        description=(
            "With one replica, clients reach it on its own HTTP port (Serve's direct ingress; that URL is "
            "base_url) instead of through Serve's HTTP proxy actor, which stays on `port`."
        ),
    )
    admin_token: str | None = Field(
        None, description="Token for the /gyre admin API; a random one is generated when unset."
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above it)."
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Longest wait for the next piece of a request body; then a 503 with Retry-After (a body lost "
            "between Serve's HTTP proxy and a replica that died, or a client that stopped sending)."
        ),
    )
    max_tokens_ceiling: int = Field(
        1 << 20,
        ge=1,
        description="max_tokens above this is rejected with a 400; below it, max_tokens is capped to the context.",
    )
    max_output_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens generated per call whatever the request asks (None: up to the context).",
    )
    default_max_tokens: int = Field(
        1024, ge=1, description="Completion budget when an OpenAI request gives no max_tokens."
    )
    durable_records: bool = Field(
        True,
        description="A call returns (its last byte is sent) only once the store actor has its record on "
        "file (the execution's JSONL), so neither a replica nor the store dying afterwards loses it; "
        "calls ending together share one store call and one fsync.",
    )
    fsync_records: bool = Field(
        True,
        description="With durable_records, fsync each batch of records to its execution's file before "
        "acknowledging it (off: records survive the store actor's death, not the machine's).",
    )
    records_dir: str = Field(
        "runs/records", description="Folder where finished (or evicted) executions spill as JSONL."
    )
    store_max_records: int = Field(
        20_000, ge=1, description="Call records the trajectory store keeps in memory before spilling to disk."
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Longest a single model call may run before it is aborted."
    )
