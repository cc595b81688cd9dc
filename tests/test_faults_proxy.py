"""A proxy replica dies under load: harnesses see only 200s or retryable errors, and no returned call is unrecorded.

Rollout-only cells (scripted engine) behind two Serve replicas, reached through Serve's HTTP proxy
(`serve_url`: with several replicas there is no direct ingress). Harness threads call the proxy in
a loop, retrying a 429/503 after its Retry-After (and a dropped connection after a second) as a
harness would; one replica actor is killed mid-run and Serve replaces it. No call hangs; only the
calls that were inside the killed replica fail, each with a retryable 503 + Retry-After (Serve's
HTTP proxy runs `gyre_ray.proxy.serve_errors`), never a 500 or a dropped connection; every call a
harness got a 200 for is in the store (a record is on file before its call's last byte). A call
the router re-sent after the replica took its body and died gets a 503 after `proxy.body_timeout_s`
(`app._read_body`) instead of waiting for the body until the client gives up.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
import ray

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.config import load_config
from gyre_ray.proxy.launch import start_proxy
from gyre_ray.runtime.cluster import start_local_ray

pytestmark = pytest.mark.slow

OVERRIDES = ["cells.num_cells=2", "cells.cpus_per_cell=0.5", "proxy.port=0", "proxy.num_replicas=2"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ray import serve

    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    folder = tmp_path_factory.mktemp("records")
    cfg = load_config("jobs/configs/toy.yaml", [*OVERRIDES, f"proxy.records_dir={folder}"])
    handle = start_proxy(
        cfg, ScriptedEngineFactory({"reply_length": 16, "token_delay_s": 0.004}), timeout_s=300
    )
    yield handle
    handle.shutdown()
    serve.shutdown()
    ray.shutdown()


def replica_names() -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::gyre-proxy")
    )


class Harness(threading.Thread):
    """Calls until `stop`; counts 200s and every other outcome."""

    def __init__(self, base_url: str, api_key: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.base_url, self.api_key, self.stop = base_url, api_key, stop
        self.ok = 0
        self.outcomes: Counter[str] = Counter()
        self.missing_retry_after = 0
        self.slowest_s = 0.0

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 12}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=60.0) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    reply = client.post("/v1/chat/completions", json=body)
                except httpx.TransportError as exc:  # the connection was cut: retry shortly
                    self.outcomes[type(exc).__name__] += 1
                    time.sleep(1.0)
                    continue
                finally:
                    self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                self.outcomes[str(reply.status_code)] += 1
                if reply.status_code == 200:
                    self.ok += 1
                elif reply.status_code in (429, 503):
                    self.missing_retry_after += "retry-after" not in reply.headers
                    time.sleep(float(reply.headers.get("retry-after", "1")))


def test_a_dead_replica_costs_no_returned_call_its_record(served) -> None:
    replicas = replica_names()
    assert len(replicas) == 2, replicas
    stop = threading.Event()
    executions = [served.register_execution() for _ in range(4)]
    harnesses = [Harness(served.serve_url, e["api_key"], stop) for e in executions]
    for h in harnesses:
        h.start()
    time.sleep(3.0)
    ray.kill(ray.get_actor(replicas[0], namespace="serve"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (replicas[0] in replica_names() or len(replica_names()) < 2):
        time.sleep(0.5)
    time.sleep(3.0)  # calls go on through the replacement
    stop.set()
    for h in harnesses:
        h.join(timeout=120)
    outcomes = sum((h.outcomes for h in harnesses), Counter())
    print("outcomes", dict(outcomes), "slowest", max(h.slowest_s for h in harnesses))
    assert len(replica_names()) == 2 and replicas[0] not in replica_names()
    assert all(h.ok > 0 for h in harnesses)
    assert max(h.slowest_s for h in harnesses) < 60, "a call hung"
    assert sum(h.missing_retry_after for h in harnesses) == 0
    # The calls inside the killed replica get a 503 with Retry-After (at most one per harness, each
    # of which has one call in flight), never a 500 or a cut connection.
    assert set(outcomes) <= {"200", "429", "503"}, outcomes
    assert outcomes["503"] <= len(harnesses), outcomes
    for execution, harness in zip(executions, harnesses, strict=True):
        records = served.records(execution["execution_id"])
        assert len(records) >= harness.ok, (execution, len(records), harness.ok)
