"""The agent proxy on Ray Serve: deploy it in front of running cells, and its admin API as Python calls.

    handle = start_proxy(load_config("jobs/configs/toy.yaml"))   # a whole runtime of rollout-only cells
    key = handle.register_execution()["api_key"]     # then point a harness at handle.base_url
    records = handle.records(execution_id)           # list[CallRecord]
    handle.shutdown()

`serve_proxy` only deploys the Serve app over cells and a store that already run (the run's owner,
`gyre_ray.runtime.cluster.Runtime`, starts those). `start_proxy` is the convenience `gyre-ray serve` and
tests use: a `Runtime` with rollout-only cells, returned as its proxy handle (shutting it down stops all).
`engine_factory` defaults to the configured policy behind the configured engine backend; tests
pass a `ScriptedEngineFactory`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gyre_ray.cells.cell import EngineFactory
from gyre_ray.config import ConfigError, GyreConfig
from gyre_ray.ports import free_port, is_free
from gyre_ray.proxy.config import ProxySection
from gyre_ray.trajectory.records import CallRecord


@dataclass
class ProxyHandle:
    """A running proxy: where it listens, its admin token, and the admin API as Python calls."""

    base_url: str
    admin_token: str
    cell_ids: list[str]
    records_dir: str
    app_name: str
    serve_url: str = ""  # Serve's HTTP proxy in front of the same app ("" when unknown)
    owner: Any = None  # the Runtime that started the cells behind it
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120.0))

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
        """Drain a cell (its own flag; every replica follows it), moving its in-flight calls; returns how many moved."""
        return self._admin("POST", f"/gyre/cells/{cell_id}/drain").json()["migrated"]

    def undrain(self, cell_id: str) -> None:
        self._admin("POST", f"/gyre/cells/{cell_id}/undrain")

    def cells(self) -> list[dict[str, Any]]:
        return self._admin("GET", "/gyre/cells").json()["cells"]

    def stats(self) -> dict[str, Any]:
        return self._admin("GET", "/gyre/stats").json()

    def cell_actors(self) -> dict[str, Any]:
        """The cell actors by cell id, in pool order."""
        if self.owner is None:
            raise RuntimeError("this proxy handle has no runtime: its cells are not known here")
        return self.owner.cells

    def close(self) -> None:
        """Delete the Serve app (the cells and store stay; their owner stops them)."""
        from ray import serve

        self._http.close()
        with contextlib.suppress(Exception):  # Serve already gone
            serve.delete(self.app_name)

    def shutdown(self) -> None:
        """Stop everything the proxy's runtime started (or just the app when it has none)."""
        if self.owner is not None:
            self.owner.shutdown()
        else:
            self.close()


def serve_proxy(
    config: GyreConfig,
    settings: dict[str, Any],
    cell_ids: list[str],
    *,
    app_name: str = "gyre-proxy",
    timeout_s: float = 300.0,
) -> ProxyHandle:
    """Deploy the Serve proxy over running cells and store (`settings` from `start_backends`); wait until healthy.

    With `proxy.direct_ingress` (and one replica) `base_url` is the replica's own HTTP port when
    Serve runs with direct ingress (this function turns it on when it starts Serve), else Serve's
    HTTP proxy; `serve_url` is always Serve's HTTP proxy (on `proxy.port`), which serves the same app.
    """
    from ray import serve

    from gyre_ray.proxy.serve_app import DIRECT_INGRESS_ENV, proxy_application
    from gyre_ray.proxy.serve_errors import proxy_env

    section = config.proxy
    direct = section.direct_ingress and section.num_replicas == 1
    settings = {**settings, "direct_ingress": direct}
    port = section.port or free_port(section.host)  # a port in use: refused before the cells start
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    # controller options only apply when this call starts Serve; a running Serve keeps its own
    # (Serve's HTTP proxy actors inherit the controller's env: a dead replica's calls get a 503)
    env = {**proxy_env(section.retry_after_s), **(DIRECT_INGRESS_ENV if direct else {})}
    controller = {"runtime_env": {"env_vars": env}}
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
    try:
        _wait_healthy(base_url, timeout_s)
    except BaseException:
        with contextlib.suppress(Exception):
            serve.delete(app_name)
        raise
    return ProxyHandle(
        base_url, settings["admin_token"], list(cell_ids), settings["records_dir"], app_name, serve_url
    )


def start_proxy(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    *,
    app_name: str = "gyre-proxy",
    timeout_s: float = 300.0,
) -> ProxyHandle:
    """A runtime of rollout-only cells (no scheduler) behind the proxy; returns its proxy handle."""
    from gyre_ray.runtime.cluster import Runtime

    runtime = Runtime.start(config, engine_factory, dual_role=False, app_name=app_name, timeout_s=timeout_s)
    return runtime.proxy


def refuse_busy_port(section: ProxySection) -> None:
    """A `ConfigError` naming `proxy.port` when Serve would have to start on a port in use (Serve's
    own error is a Ray traceback from its HTTP proxy actor); a running Serve keeps its port."""
    # Serve's HTTP proxy binds with SO_REUSEPORT (unless SERVE_SOCKET_REUSE_PORT_ENABLED=0): it shares
    # a port with another Serve's, and fails only on a port held by anything else
    reuse = os.environ.get("SERVE_SOCKET_REUSE_PORT_ENABLED", "1") == "1"
    if section.port and not _serve_running() and not is_free(section.host, section.port, reuse):
        raise ConfigError(
            f"proxy.port={section.port}: {section.host}:{section.port} is already in use (another proxy "
            "or server); give another port, or proxy.port=0 for any free one"
        )


def _serve_running() -> bool:
    """Whether Serve runs in this Ray cluster already (it then keeps its own HTTP port)."""
    from ray.serve.context import _get_global_client

    try:
        return _get_global_client(raise_if_no_controller_running=False) is not None
    except Exception:
        return False


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
