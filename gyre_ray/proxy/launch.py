"""Start the proxy stack from Python: local Ray (if needed), the store, N rollout cells, Ray Serve.

    handle = start_proxy(load_config("jobs/configs/toy.yaml"))
    key = handle.register_execution()["api_key"]     # then point a harness at handle.base_url
    records = handle.records(execution_id)           # list[CallRecord]
    handle.shutdown()

`engine_factory` defaults to the configured policy behind the configured engine backend; tests
pass a `ScriptedEngineFactory`. `gyre-ray serve` is a thin CLI over this.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gyre_ray.cells.cell import EngineFactory
from gyre_ray.config import GyreConfig
from gyre_ray.proxy.config import ProxySection
from gyre_ray.trajectory.records import CallRecord

NAMESPACE = "gyre-ray"


@dataclass
class ProxyHandle:
    """A running proxy: where it listens, its admin token, and the admin API as Python calls."""

    base_url: str
    admin_token: str
    cell_ids: list[str]
    records_dir: str
    app_name: str
    _pool: Any = None
    _store: Any = None
    _owns_ray: bool = False
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120.0))
    serve_url: str = ""  # Serve's HTTP proxy in front of the same app ("" when unknown)

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def _admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        response = self._http.request(method, self.base_url + path, headers=headers, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path} failed with {response.status_code}: {response.text[:500]}")
        return response

    def register_execution(
        self, execution_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """A new execution: {"execution_id", "api_key"}."""
        body: dict[str, Any] = {}
        if execution_id is not None:
            body["execution_id"] = execution_id
        if metadata is not None:
            body["metadata"] = metadata
        return self._admin("POST", "/gyre/executions", json=body).json()

    def records(self, execution_id: str) -> list[CallRecord]:
        """The execution's call records, in call order."""
        text = self._admin("GET", f"/gyre/executions/{execution_id}/records").text
        return [CallRecord.from_json(line) for line in text.splitlines() if line.strip()]

    def finish_execution(self, execution_id: str) -> str:
        """Spill the execution's records to disk; returns the JSONL path."""
        return self._admin("POST", f"/gyre/executions/{execution_id}/finish").json()["records_path"]

    def drain(self, cell_id: str) -> int:
        """Take a cell out of routing, moving its in-flight calls; returns how many moved."""
        return self._admin("POST", f"/gyre/cells/{cell_id}/drain").json()["migrated"]

    def undrain(self, cell_id: str) -> None:
        self._admin("POST", f"/gyre/cells/{cell_id}/undrain")

    def cells(self) -> list[dict[str, Any]]:
        return self._admin("GET", "/gyre/cells").json()["cells"]

    def stats(self) -> dict[str, Any]:
        return self._admin("GET", "/gyre/stats").json()

    def cell_actors(self) -> dict[str, Any]:
        """The cell actors by cell id, in pool order (the core first)."""
        return {cell_id: self._pool.actors[cell_id] for cell_id in self.cell_ids}

    def shutdown(self) -> None:
        """Delete the Serve app, kill the cells and the store; stop Ray if this handle started it."""
        import ray
        from ray import serve

        self._http.close()
        with contextlib.suppress(Exception):  # Serve already gone
            serve.delete(self.app_name)
        if self._pool is not None:
            self._pool.shutdown()
        if self._store is not None:
            ray.kill(self._store, no_restart=True)
        if self._owns_ray:
            serve.shutdown()
            ray.shutdown()


def local_ray_cpus(section: ProxySection) -> int:
    """CPUs a private local Ray declares: the machine's, and at least what the cells' bundles reserve."""
    return max(os.cpu_count() or 1, math.ceil(section.num_cells * section.cpus_per_cell))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_backends(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    *,
    trainer_factory: Any = None,
    admin_token: str | None = None,
    detached: bool = False,
    timeout_s: float = 300.0,
) -> tuple[dict[str, Any], Any, Any]:
    """Start the trajectory store and the cells (named actors); return (deployment settings, pool, store).

    `trainer_factory`: the cells are dual-role (rollout or training); `detached`: the actors outlive
    the calling process (for `serve run` / `serve deploy` builders).
    """
    from gyre_ray.cells.factories import PolicyEngineFactory
    from gyre_ray.cells.pool import CellPool
    from gyre_ray.proxy.store import create_store_actor

    section = config.proxy
    if engine_factory is None:
        engine_factory = PolicyEngineFactory(config.model.model_dump(), config.engine.model_dump())
    tag = secrets.token_hex(3)
    store_name = f"gyre-{tag}-store"
    records_dir = str(Path(section.records_dir).resolve())
    store = create_store_actor(records_dir, section.store_max_records, store_name, NAMESPACE, detached)
    try:
        pool = CellPool.start(
            section.num_cells,
            engine_factory,
            section.cpus_per_cell,
            prefix=f"gyre-{tag}-cell",
            timeout_s=timeout_s,
            namespace=NAMESPACE,
            detached=detached,
            stream_interval_s=section.stream_interval_s,
            trainer_factory=trainer_factory,
        )
    except BaseException:
        import ray

        ray.kill(store, no_restart=True)
        raise
    settings = {
        "proxy": section.model_dump(),
        "model": config.model.model_dump(),
        "namespace": NAMESPACE,
        "cells": pool.actor_names,
        "store": store_name,
        "admin_token": admin_token or section.admin_token or secrets.token_urlsafe(24),
        "records_dir": records_dir,
    }
    return settings, pool, store


def start_proxy(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    *,
    trainer_factory: Any = None,
    app_name: str = "gyre-proxy",
    timeout_s: float = 300.0,
) -> ProxyHandle:
    """Start store, cells and the Serve proxy; wait until it answers; return its handle.

    With `proxy.direct_ingress` (and one replica) `base_url` is the replica's own HTTP port when
    Serve runs with direct ingress (this function turns it on when it starts Serve), else Serve's
    HTTP proxy; `serve_url` is always Serve's HTTP proxy (on `proxy.port`), which serves the same app.
    """
    import ray
    from ray import serve

    from gyre_ray.proxy.serve_app import DIRECT_INGRESS_ENV, proxy_application

    section = config.proxy
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(
            address="local",
            num_cpus=local_ray_cpus(section),
            include_dashboard=False,
            logging_level="WARNING",
        )
    direct = section.direct_ingress and section.num_replicas == 1
    pool = store = None
    try:
        settings, pool, store = start_backends(
            config, engine_factory, trainer_factory=trainer_factory, timeout_s=timeout_s
        )
        settings["direct_ingress"] = direct
        port = section.port or free_port(section.host)
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        # controller options only apply when this call starts Serve; a running Serve keeps its own
        controller = {"runtime_env": {"env_vars": dict(DIRECT_INGRESS_ENV)}} if direct else None
        serve.start(
            http_options={"host": section.host, "port": port},
            logging_config=quiet,
            controller_options=controller,
        )
        serve.run(
            proxy_application(settings),
            name=app_name,
            route_prefix="/",
            blocking=False,
            logging_config=quiet,
        )
        serve_url = _serve_base_url(section.host, port)
        base_url = (_direct_ingress_url(app_name, section.host, serve_url) if direct else None) or serve_url
        _wait_healthy(base_url, timeout_s)
    except BaseException:
        if pool is not None:
            pool.shutdown()
        if store is not None:
            ray.kill(store, no_restart=True)
        if owns_ray:
            ray.shutdown()
        raise
    return ProxyHandle(
        base_url,
        settings["admin_token"],
        pool.cell_ids,
        settings["records_dir"],
        app_name,
        pool,
        store,
        owns_ray,
        serve_url=serve_url,
    )


def _serve_base_url(host: str, requested_port: int) -> str:
    """Serve keeps the HTTP options of its first start in a cluster; use the port it really serves on."""
    from ray.serve.context import _get_global_client

    port = requested_port
    with contextlib.suppress(Exception):  # no client details: trust the requested port
        port = int(_get_global_client().http_config.port)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{connect_host}:{port}"


def _direct_ingress_url(app_name: str, host: str, serve_url: str, wait_s: float = 10.0) -> str | None:
    """The URL of the app's one replica when Serve reports it on its own port (direct ingress), else None.

    Serve lists where each app is reached as target groups (`ServeInstanceDetails.target_groups`):
    the replicas' ports with direct ingress, the HTTP proxies' without.
    """
    from ray.serve.context import _get_global_client

    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    serve_port = int(serve_url.rsplit(":", 1)[1])
    deadline = time.monotonic() + wait_s
    while True:
        ports: list[int] = []
        with contextlib.suppress(Exception):  # details not available: Serve's proxy still serves
            details = _get_global_client().get_serve_details()
            for group in details.get("target_groups", []):
                group = group if isinstance(group, dict) else group.model_dump()
                if group.get("app_name") == app_name and str(group.get("protocol")).endswith("HTTP"):
                    ports += [int(t["port"]) for t in group.get("targets", [])]
        direct = sorted({p for p in ports if p != serve_port})
        if len(direct) == 1:
            return f"http://{connect_host}:{direct[0]}"
        if ports and not direct:  # Serve runs without direct ingress (started elsewhere)
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def _wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            response = httpx.get(base_url + "/gyre/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"status {response.status_code}"
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"the proxy at {base_url} did not become healthy within {timeout_s:.0f} s ({last})")


def describe(handle: ProxyHandle) -> str:
    """The one JSON line `gyre-ray serve` prints."""
    return json.dumps(
        {
            "base_url": handle.base_url,
            "openai_base_url": handle.openai_base_url,
            "serve_url": handle.serve_url or handle.base_url,
            "admin_token": handle.admin_token,
            "cells": handle.cell_ids,
            "records_dir": handle.records_dir,
        }
    )
