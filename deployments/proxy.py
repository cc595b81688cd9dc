"""Ray Serve entry point of the gyre-ray agent proxy, for Serve's own tooling.

    serve run deployments/proxy.yaml                       # from the repository root
    serve run deployments.proxy:app_builder config=jobs/configs/toy.yaml

`app_builder` starts the trajectory store and the rollout cells as detached named actors (they must
outlive the builder, which Serve may run in a short-lived process), then returns the bound proxy
deployment. It prints the admin token once; set `proxy.admin_token` in the config to choose it.
From Python, prefer `gyre_ray.proxy.launch.start_proxy`, which also shuts everything down.
"""

from __future__ import annotations

from typing import Any

from gyre_ray.config import load_config
from gyre_ray.proxy.serve_app import proxy_application
from gyre_ray.runtime.cluster import start_backends


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder. args: `config` (YAML path, optional), `overrides` (list of key=value)."""
    overrides = args.get("overrides") or []
    if isinstance(overrides, str):
        overrides = overrides.split()
    config = load_config(args.get("config"), list(overrides))
    settings, pool, _store = start_backends(config, detached=True)
    print(f"gyre-ray proxy: cells {pool.cell_ids}; admin token {settings['admin_token']}", flush=True)
    return proxy_application(settings)
