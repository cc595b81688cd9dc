"""Live metrics for the Ray dashboard (Prometheus format on the metrics export port).

    metrics = RuntimeMetrics.create()         # in the scheduler actor (needs ray[default])
    metrics.cells_by_role({"rollout": 3, "train": 1})
    metrics.switch_latency("to_train", 8.5)

Names carry a `gyre_` prefix, and Ray adds `ray_` when it exports them (`ray_gyre_cells`). Counters
(`*_total`) are meant to be read as rates (tokens per second = `rate(...[1m])`). `ProxyMetrics` is
the proxy replicas' part (request latency by API, errors by status). The Grafana dashboard for all
of them is `deployments/grafana/gyre-ray.json`. Where Ray's metrics agent is absent every call is a
no-op, so metrics never stop a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

# a CPU cell switches in 0.02-0.2 s, a GPU cell in seconds: buckets for both (a quantile is
# interpolated inside its bucket, so one bucket for all of 0-0.25 s would make up the figures)
SWITCH_BUCKETS = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STALENESS_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5]


class _Null:
    """Stands in for a metric when Ray's metrics cannot be made."""

    def set(self, *_: Any, **__: Any) -> None: ...

    def inc(self, *_: Any, **__: Any) -> None: ...

    def observe(self, *_: Any, **__: Any) -> None: ...


def _make(kind: str, name: str, description: str, tags: tuple[str, ...], **options: Any) -> Any:
    try:
        from ray.util import metrics

        return getattr(metrics, kind)(name, description=description, tag_keys=tags, **options)
    except Exception:  # no metrics agent (e.g. ray without [default]): keep running without metrics
        return _Null()


class RuntimeMetrics:
    """What the scheduler actor exports: roles, executions, queue, tokens, staleness, switches."""

    def __init__(self) -> None:
        self.cells = _make("Gauge", "gyre_cells", "Cells per role (rollout, train, switching).", ("role",))
        self.executions = _make(
            "Gauge", "gyre_executions", "Executions by state (running, pending).", ("state",)
        )
        self.queue = _make(
            "Gauge", "gyre_microbatch_queue_depth", "Micro-batches queued, not yet claimed.", ()
        )
        self.trained = _make("Counter", "gyre_tokens_trained_total", "Tokens trained, per cell.", ("cell",))
        self.generated = _make(
            "Counter", "gyre_tokens_generated_total", "Tokens generated, per cell.", ("cell",)
        )
        self.staleness = _make(
            "Histogram", "gyre_trained_token_staleness", "Policy-version lag of trained tokens.", (),
            boundaries=STALENESS_BUCKETS,
        )  # fmt: skip
        self.staleness_max = _make(
            "Gauge", "gyre_staleness_max", "Largest lag of the last update's tokens.", ()
        )
        self.staleness_mean = _make(
            "Gauge", "gyre_staleness_mean", "Mean lag of the last update's tokens.", ()
        )
        self.switches = _make(
            "Histogram", "gyre_switch_seconds", "Role switch latency by direction.", ("direction",),
            boundaries=SWITCH_BUCKETS,
        )  # fmt: skip
        self.version = _make("Gauge", "gyre_policy_version", "Policy version last published.", ())

    @classmethod
    def create(cls) -> RuntimeMetrics:
        return cls()

    def cells_by_role(self, counts: Mapping[str, int]) -> None:
        for role in ("rollout", "train", "switching"):
            self.cells.set(float(counts.get(role, 0)), tags={"role": role})

    def execution_counts(self, running: int, pending: int) -> None:
        self.executions.set(float(running), tags={"state": "running"})
        self.executions.set(float(pending), tags={"state": "pending"})

    def queue_depth(self, depth: int) -> None:
        self.queue.set(float(depth))

    def tokens(self, cell: str, trained: int = 0, generated: int = 0) -> None:
        if trained > 0:
            self.trained.inc(float(trained), tags={"cell": cell})
        if generated > 0:
            self.generated.inc(float(generated), tags={"cell": cell})

    def trained_staleness(self, lags: Mapping[int, int]) -> None:
        """`lags`: policy-version lag -> number of trained tokens with that lag. The mean is a gauge of
        its own: the histogram takes at most 10,000 tokens per lag, and Ray sums it from bucket
        midpoints (a lag-0 token adds 0.25), so its `_sum / _count` is no mean lag."""
        for lag, count in lags.items():
            for _ in range(min(int(count), 10_000)):  # a histogram counts observations one by one
                self.staleness.observe(float(lag))
        tokens = sum(lags.values())
        if lags and tokens > 0:
            self.staleness_max.set(float(max(lags)))
            self.staleness_mean.set(sum(lag * count for lag, count in lags.items()) / tokens)

    def switch_latency(self, direction: str, seconds: float) -> None:
        self.switches.observe(float(seconds), tags={"direction": direction})

    def published(self, version: int) -> None:
        self.version.set(float(version))


class ProxyMetrics:
    """What each proxy replica exports: request latency by API and errors by status."""

    def __init__(self) -> None:
        self.latency = _make(
            "Histogram", "gyre_proxy_request_seconds", "Proxy model-call latency by API.", ("api",),
            boundaries=LATENCY_BUCKETS,
        )  # fmt: skip
        self.errors = _make(
            "Counter", "gyre_proxy_errors_total", "Proxy error responses by status.", ("status",)
        )
        self.requests = _make("Counter", "gyre_proxy_requests_total", "Proxy model calls by API.", ("api",))

    def request(self, api: str, seconds: float, status: int) -> None:
        with contextlib.suppress(Exception):
            self.requests.inc(1.0, tags={"api": api})
            self.latency.observe(float(seconds), tags={"api": api})
            if status >= 400:
                self.errors.inc(1.0, tags={"status": str(status)})
