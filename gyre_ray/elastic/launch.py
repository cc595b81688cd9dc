"""Start dual-role cells on Ray and the proxy in front of them.

`start_dual_role_pool` mirrors `gyre_ray.cells.pool.CellPool.start` (one placement group per cell,
one named actor inside it) but starts `DualRoleCell`s, each with a trainer replica; it returns a
plain `CellPool`, so everything that reads a pool (the proxy handle's `update_weights`, `shutdown`)
works unchanged. `start_elastic_proxy` is `gyre_ray.proxy.launch.start_proxy` over such a pool: the
Serve proxy looks cells up by actor name and only calls the rollout methods, which a dual-role
cell keeps.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from gyre_ray.cells.cell import EngineFactory
from gyre_ray.cells.dual_role import DualRoleCell, TrainerFactory
from gyre_ray.cells.pool import CellPool, plan_cells
from gyre_ray.config import GyreConfig

NAMESPACE = "gyre-ray"


def start_dual_role_pool(
    num_cells: int,
    engine_factory: EngineFactory,
    trainer_factory: TrainerFactory,
    cpus_per_cell: float = 1.0,
    prefix: str = "gyre-cell",
    timeout_s: float = 300.0,
    namespace: str | None = NAMESPACE,
) -> CellPool:
    """Reserve one placement group per cell, start a `DualRoleCell` in each, wait for engine + trainer."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pool = CellPool(plan_cells(num_cells, cpus_per_cell, prefix), namespace=namespace)
    actor_cls = ray.remote(DualRoleCell)
    try:
        for spec in pool.specs:
            pool.groups[spec.cell_id] = placement_group(
                spec.bundles, strategy="PACK", name=f"{spec.actor_name}-pg"
            )
        ray.get([g.ready() for g in pool.groups.values()], timeout=timeout_s)
        for index, spec in enumerate(pool.specs):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pool.groups[spec.cell_id], placement_group_bundle_index=0
            )
            pool.actors[spec.cell_id] = actor_cls.options(
                name=spec.actor_name,
                namespace=namespace,
                num_cpus=spec.bundles[0]["CPU"],
                scheduling_strategy=strategy,
                max_concurrency=1000,
            ).remote(spec.cell_id, engine_factory, trainer_factory, spec.torch_threads, index == 0)
        ray.get([a.setup.remote() for a in pool.actors.values()], timeout=timeout_s)
    except BaseException:
        pool.shutdown()
        raise
    return pool


def trainer_factory_for(config: GyreConfig) -> TrainerFactory:
    """The trainer replica every cell builds: the job's model, trainer and algo sections."""
    return TrainerFactory(config.model.model_dump(), config.trainer.model_dump(), config.algo.model_dump())


def start_elastic_proxy(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    trainer_factory: TrainerFactory | None = None,
    *,
    app_name: str = "gyre-proxy",
    timeout_s: float = 300.0,
) -> Any:
    """Store, `proxy.num_cells` dual-role cells and the Serve proxy; returns a `ProxyHandle`.

    Ray must already be initialised (the job's `connect_ray`, or a test's `ray.init`).
    """
    import ray
    from ray import serve

    from gyre_ray.cells.factories import PolicyEngineFactory
    from gyre_ray.proxy.launch import ProxyHandle, free_port
    from gyre_ray.proxy.serve_app import proxy_application
    from gyre_ray.proxy.store import create_store_actor

    if not ray.is_initialized():
        raise RuntimeError("start_elastic_proxy: initialise Ray first")
    section = config.proxy
    engine_factory = engine_factory or PolicyEngineFactory(
        config.model.model_dump(), config.engine.model_dump()
    )
    trainer_factory = trainer_factory or trainer_factory_for(config)
    tag = secrets.token_hex(3)
    records_dir = str(Path(section.records_dir).resolve())
    store_name = f"gyre-{tag}-store"
    store = create_store_actor(records_dir, section.store_max_records, store_name, NAMESPACE)
    pool = None
    try:
        pool = start_dual_role_pool(
            section.num_cells,
            engine_factory,
            trainer_factory,
            section.cpus_per_cell,
            prefix=f"gyre-{tag}-cell",
            timeout_s=timeout_s,
        )
        settings = {
            "proxy": section.model_dump(),
            "model": config.model.model_dump(),
            "namespace": NAMESPACE,
            "cells": pool.actor_names,
            "store": store_name,
            "admin_token": section.admin_token or secrets.token_urlsafe(24),
            "records_dir": records_dir,
        }
        port = section.port or free_port(section.host)
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": section.host, "port": port}, logging_config=quiet)
        serve.run(
            proxy_application(settings), name=app_name, route_prefix="/", blocking=False, logging_config=quiet
        )
        base_url = f"http://{'127.0.0.1' if section.host in ('0.0.0.0', '::') else section.host}:{port}"
        _wait_healthy(base_url, timeout_s)
    except BaseException:
        if pool is not None:
            pool.shutdown()
        ray.kill(store, no_restart=True)
        raise
    return ProxyHandle(
        base_url, settings["admin_token"], pool.cell_ids, records_dir, app_name, pool, store, False
    )


def cpus_for(config: GyreConfig) -> int:
    """CPUs a private local Ray needs for the cells (at least the machine's)."""
    return max(os.cpu_count() or 1, math.ceil(config.proxy.num_cells * config.proxy.cpus_per_cell))


def _wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(base_url + "/gyre/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"status {response.status_code}"
        time.sleep(0.2)
    raise TimeoutError(f"the proxy at {base_url} did not become healthy within {timeout_s:.0f} s ({last})")
