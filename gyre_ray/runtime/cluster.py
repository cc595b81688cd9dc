"""One owner for the cluster of a run: it starts, names and shuts down every long-lived actor.

    runtime = Runtime.start(cfg)          # Ray (if needed), store, cells, Serve proxy, scheduler actor
    runtime.scheduler                     # the `scheduler` actor (gyre_ray.runtime.scheduler)
    runtime.cells["cell-0"], runtime.core_id
    runtime.shutdown()

In the run's Ray namespace (`runtime.namespace`) the cells are the named actors `cell-0`, `cell-1`, ...,
the trajectory store is `store`, the scheduler is `scheduler` and the warm worker of executions and
group processing is `workers`, so the Ray dashboard and tools find them. The cells share one
placement group with one bundle {"CPU": c, "GPU": g} per cell from the `cells` section
(`cells.strategy` spreads or packs them over nodes). The scheduler actor gets the pool: it restarts a cell that died.
Ray restarts a dead scheduler actor (`run.max_scheduler_restarts`; it reattaches, `runtime/reattach.py`)
and a dead durable store (`proxy.durable_records`; it replays its files).
The core is the cell this runtime names (`core_id`; cell-0 today), whatever the cells are called.
A cell's drain flag lives in the cell; every proxy replica routes by it (`ProxyService.watch_drain_state`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_ray.cells.cell import EngineFactory
from gyre_ray.config import ConfigError, GyreConfig

STORE_NAME = "store"
SCHEDULER_NAME = "scheduler"


def local_ray_cpus(config: GyreConfig) -> int:
    """CPUs a private local Ray declares: the machine's, and at least what the cells' bundles reserve."""
    cells = config.cells
    return max(os.cpu_count() or 1, math.ceil(cells.num_cells * cells.cpus_per_cell))


def connect_ray(config: GyreConfig) -> bool:
    """Join the cluster under `ray job submit` (RAY_ADDRESS set), else start a private local Ray.

    Returns True when this call started Ray (the caller then shuts it down). No-op if Ray is up.
    """
    import ray

    if ray.is_initialized():
        return False
    import ray.serve  # noqa: F401  (its import sets Serve's driver logger to INFO: quieten it after)

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the job prints its own progress
    if os.environ.get("RAY_ADDRESS"):
        check_ray_address(os.environ["RAY_ADDRESS"])
        ray.init(logging_level="WARNING")
    else:
        wanted, cores = config.cells.num_cells * config.cells.cpus_per_cell, os.cpu_count() or 1
        if wanted > cores:
            print(
                f"gyre-ray: the cells reserve {wanted:g} CPUs (cells.num_cells x cells.cpus_per_cell) on a "
                f"machine with {cores}: a private local Ray declares {math.ceil(wanted)}, so they share cores "
                "and run slower (fine for a test)",
                file=sys.stderr,
            )
        gpus = math.ceil(config.cells.num_cells * config.cells.gpus_per_cell)
        options: dict = (
            {"_metrics_export_port": config.run.metrics_export_port} if config.run.metrics_export_port else {}
        )
        start_local_ray(
            num_cpus=local_ray_cpus(config), num_gpus=gpus or None, include_dashboard=config.run.dashboard,
            logging_level="WARNING", **options,
        )  # fmt: skip
    warn_if_sandboxes_reach_ray(config)
    return True


def warn_if_sandboxes_reach_ray(config: GyreConfig) -> None:
    """Executions run as sandbox uids on this host, but with Ray's token auth off nothing stops their
    code from talking to the cluster's ports here (docs/harnesses.md, "The sandbox"): say so."""
    from gyre_ray.agents.sandbox import own_uids, protect_ray_credentials

    if not own_uids(config.agents.isolation):
        return
    protect_ray_credentials()  # the token Ray just wrote, readable by all
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        print(
            "gyre-ray: warning: RAY_AUTH_MODE=disabled: sandboxed executions can reach this Ray cluster's "
            "ports on this host and control it; keep Ray's token auth on, or block the sandbox group's "
            'loopback traffic except to the proxy (docs/harnesses.md, "The sandbox")',
            file=sys.stderr,
        )


LOCAL_RAY_ATTEMPTS = 3
_AUTH_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a `host:port` RAY_ADDRESS that nothing answers at: `ray.init` would wait for its GCS for
    many minutes before failing. Other forms (`auto`, `ray://...`) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()  # [::1]:6379
    except OSError as exc:
        raise ConfigError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
            "(`ray start --head`) or unset RAY_ADDRESS for a private local Ray"
        ) from None


def start_local_ray(**options: Any) -> None:
    """`ray.init(address="local", ...)`, tried again when the new node misses Ray's fixed 30 s start-up
    wait (its raylet registers late on a machine busy with other work); other errors propagate. The
    failed attempt's processes are left to the reaper Ray spawned with them, which ends them when this
    driver exits. Ray's token auth stays on (unless RAY_AUTH_MODE says otherwise)."""
    import ray

    # Ray's default for a new local cluster is token auth, enabled with a warning line at every start
    # that tells how to opt out: the auth stays, the line goes
    logging.getLogger(_AUTH_SETUP_LOGGER).setLevel(logging.ERROR)
    for attempt in range(1, LOCAL_RAY_ATTEMPTS + 1):
        try:
            ray.init(address="local", **options)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(exc) or attempt == LOCAL_RAY_ATTEMPTS:
                raise
            ray.shutdown()
            print(f"gyre-ray: local Ray did not start in time ({exc}); trying again ({attempt + 1}/"
                  f"{LOCAL_RAY_ATTEMPTS})", flush=True)  # fmt: skip


def trainer_factory_for(config: GyreConfig) -> Any:
    """The trainer replica every dual-role cell builds: the job's model, trainer and algo sections."""
    from gyre_ray.cells.dual_role import TrainerFactory

    return TrainerFactory(
        config.model.model_dump(),
        config.trainer.model_dump(),
        config.algo.model_dump(),
        config.transfer.model_dump(),
    )


def start_backends(
    config: GyreConfig,
    engine_factory: EngineFactory | None = None,
    *,
    trainer_factory: Any = None,
    namespace: str | None = None,
    admin_token: str | None = None,
    detached: bool = False,
    timeout_s: float = 300.0,
) -> tuple[dict[str, Any], Any, Any]:
    """Start the store (`store`) and the cells (`cell-<i>`) in `namespace`; return (proxy settings, pool, store).

    `trainer_factory`: the cells are dual-role; `detached`: actors outlive the caller (Serve builders).
    """
    from gyre_ray.cells.factories import PolicyEngineFactory
    from gyre_ray.cells.pool import CellPool
    from gyre_ray.proxy.store import create_store_actor

    namespace = namespace or f"gyre-{secrets.token_hex(3)}"
    if engine_factory is None:
        engine_factory = PolicyEngineFactory(config.model.model_dump(), config.engine.model_dump())
    records_dir = str(Path(config.proxy.records_dir).resolve())
    head = config.cells.control_resources()
    proxy = config.proxy
    store = create_store_actor(
        records_dir, proxy.store_max_records, STORE_NAME, namespace, detached, head,
        durable=proxy.durable_records, fsync=proxy.fsync_records,
    )  # fmt: skip
    cells = config.cells
    try:
        pool = CellPool.start(
            cells.num_cells,
            engine_factory,
            cells.cpus_per_cell,
            prefix="cell",
            timeout_s=timeout_s,
            namespace=namespace,
            detached=detached,
            stream_interval_s=config.proxy.stream_interval_s,
            trainer_factory=trainer_factory,
            gpus_per_cell=cells.gpus_per_cell,
            strategy=cells.strategy,
        )
    except BaseException:
        import ray

        ray.kill(store, no_restart=True)
        raise
    settings = {
        "proxy": config.proxy.model_dump(),
        "model": config.model.model_dump(),
        "namespace": namespace,
        "cells": pool.actor_names,
        "store": STORE_NAME,
        "admin_token": admin_token or config.proxy.admin_token or secrets.token_urlsafe(24),
        "records_dir": records_dir,
        "resources": head,
    }
    return settings, pool, store


@dataclass
class Runtime:
    """Everything a run started: Ray (maybe), the store, the cells, the proxy, the scheduler actor."""

    config: GyreConfig
    namespace: str
    pool: Any
    store: Any
    proxy: Any
    core_id: str
    scheduler: Any = None
    workers: Any = None
    runners: list[Any] = field(default_factory=list)  # `agents.runners` actors (`gyre_ray.runtime.runners`)
    owns_ray: bool = False
    app_name: str = "gyre-proxy"
    detached: bool = False  # the actors outlive the driver (`gyre_ray.live_run`)
    _closed: bool = field(default=False, repr=False)
    _actors_stopped: bool = field(default=False, repr=False)

    @property
    def cells(self) -> dict[str, Any]:
        """Cell actors by cell id, in pool order (looked up by name: a restarted cell is a new actor)."""
        import ray

        found = {}
        for cell_id, name in self.pool.actor_names.items():
            try:
                found[cell_id] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:  # dead and not (yet) restarted
                found[cell_id] = self.pool.actors[cell_id]
        return found

    @property
    def core(self) -> Any:
        return self.pool.actors[self.core_id]

    @classmethod
    def start(
        cls,
        config: GyreConfig,
        engine_factory: EngineFactory | None = None,
        *,
        dual_role: bool = True,
        scheduler: bool = True,
        namespace: str | None = None,
        app_name: str = "gyre-proxy",
        timeout_s: float = 300.0,
        scheduler_options: dict[str, Any] | None = None,
        detached: bool = False,
    ) -> Runtime:
        """Start the run's cluster. `dual_role=False`: rollout-only cells and no scheduler (`gyre-ray serve`).

        `scheduler_options`: keyword arguments of `RunScheduler` (run_dir, execute, ...). `detached`:
        every actor (and the cells' placement group) outlives the driver; only on a cluster that
        outlives it (`gyre_ray.live_run`), and `shutdown` is then the only thing that stops them.
        """

        from gyre_ray.proxy.launch import refuse_busy_port, serve_proxy

        owns_ray = connect_ray(config)
        namespace = namespace or f"gyre-{config.run.name}-{secrets.token_hex(3)}"
        trainer = trainer_factory_for(config) if dual_role else None
        pool = store = proxy = runtime = None
        try:
            refuse_busy_port(config.proxy)  # before the cells start (a minute on a small machine)
            settings, pool, store = start_backends(
                config, engine_factory, trainer_factory=trainer, namespace=namespace, timeout_s=timeout_s,
                detached=detached,
            )  # fmt: skip
            proxy = serve_proxy(config, settings, pool.cell_ids, app_name=app_name, timeout_s=timeout_s)
            runtime = cls(
                config, namespace, pool, store, proxy, pool.cell_ids[0], owns_ray=owns_ray, app_name=app_name,
                detached=detached,
            )  # fmt: skip
            proxy.owner = runtime
            if dual_role and scheduler:
                runtime.scheduler = runtime._start_scheduler(scheduler_options or {}, timeout_s)
        except BaseException:
            actors = [runtime.scheduler, runtime.workers, *runtime.runners] if runtime is not None else []
            _stop(pool, store, proxy, actors, owns_ray)
            raise
        return runtime

    def start_executors(self, timeout_s: float = 300.0) -> tuple[list[Any], str]:
        """Start where executions run: `workers` on the control node (also the run's group processing)
        and the `agents.runners` runner actors, each restarted by Ray if it dies (its executions then
        start again: `gyre_ray.runtime.runners`); returns what `agent_executors` does."""
        from gyre_ray.runtime.runners import WORKERS_NAME, start_runners
        from gyre_ray.runtime.workers import RunWorkers

        lifetime = "detached" if self.detached else None
        self.workers = RunWorkers.options(
            name=WORKERS_NAME, namespace=self.namespace, resources=self.config.cells.control_resources(),
            lifetime=lifetime, max_restarts=-1,
        ).remote()  # fmt: skip
        if self.config.agents.runners:
            self.runners = start_runners(self.config.agents, self.namespace, lifetime, timeout_s)
        return self.agent_executors(timeout_s)

    def _start_scheduler(self, options: dict[str, Any], timeout_s: float = 300.0) -> Any:
        from gyre_ray.runtime.scheduler import SchedulerActor, pack_scheduler_options

        head = self.config.cells.control_resources()
        lifetime = "detached" if self.detached else None
        runner_url = self.start_executors(timeout_s)[1]

        cell_names = {cid: name for cid, name in self.pool.actor_names.items()}
        restarts = self.config.run.max_scheduler_restarts  # a call in flight is retried on the new actor
        return SchedulerActor.options(
            name=SCHEDULER_NAME,
            namespace=self.namespace,
            resources=head,
            max_restarts=restarts,
            max_task_retries=-1 if restarts else 0,
            lifetime=lifetime,
        ).remote(
            self.config.model_dump(mode="json"),
            cell_names,
            self.core_id,
            self.namespace,
            {**self.proxy_admin(), "runner_url": runner_url},
            options_blob=pack_scheduler_options(
                {"workers": self.workers, "runners": self.runners, "pool": self.pool, **options}
            ),
        )

    def proxy_admin(self) -> dict[str, str]:
        """The proxy's address and admin token (`{"base_url", "admin_token"}`), for its admin API."""
        return {"base_url": self.proxy.base_url, "admin_token": self.proxy.admin_token}

    def agent_executors(self, timeout_s: float = 120.0) -> tuple[list[Any], str]:
        """Where executions run, and the proxy URL their harnesses call there: the runner actors
        (`agents.runners`, `gyre_ray.runtime.runners`) or `workers`. An executor Ray is restarting
        (it died: a runner killed mid-run, say) is waited for; all answer within `timeout_s`."""
        from gyre_ray.runtime.runners import WORKERS_NAME, node_ips, runner_base_url, runner_name

        if not self.runners:
            return [self.workers], self.proxy.base_url
        # (the proxy's replicas run beside `workers`, on the control node)
        names = [WORKERS_NAME, *(runner_name(i) for i in range(len(self.runners)))]
        proxy_ip, *runner_ips = node_ips([self.workers, *self.runners], names, timeout_s)
        url = runner_base_url(self.proxy.base_url, self.config.proxy.host, proxy_ip, runner_ips)
        return list(self.runners), url

    def restore(self, checkpoint: str | Path, timeout_s: float = 600.0) -> int:
        """Load a run checkpoint (`gyre_ray.checkpoint`) into the core (weights, optimizer, step, version,
        RNG) and serve its weights on every cell; returns the restored policy version. Call it before
        the scheduler runs (every cell is in rollout then)."""
        import ray

        from gyre_ray.checkpoint import trainer_dir

        version = int(ray.get(self.core.load.remote(str(trainer_dir(checkpoint))), timeout=timeout_s))
        # a plain state dict, not a published ticket: the scheduler's run publishes this version first
        weights = self.core.state_dict.remote()
        ray.get(
            [cell.update_weights.remote(weights, version) for cell in self.cells.values()], timeout=timeout_s
        )
        return version

    def stop_actors(self) -> None:
        """Stop the scheduler, `workers`, the runners, the cells and the store (the quick part of `shutdown`)."""
        if self._actors_stopped:
            return
        self._actors_stopped = True
        _stop(self.pool, self.store, None, [self.scheduler, self.workers, *self.runners], owns_ray=False)

    def shutdown(self) -> None:
        """Stop the actors (`stop_actors`), then the proxy app; stop Ray if this runtime started it."""
        if self._closed:
            return
        self._closed = True
        self.stop_actors()
        _stop(None, None, self.proxy, [], self.owns_ray)


def _stop(pool: Any, store: Any, proxy: Any, actors: list[Any], owns_ray: bool) -> None:
    """The actors first, the Serve app (the slow part) last: `ray job stop` gives a driver 3 s
    (RAY_JOB_STOP_WAIT_TIME_S) before its SIGKILL, which would leave detached actors running."""
    import ray

    for actor in actors:
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    if pool is not None:
        pool.shutdown()
    if store is not None:
        with contextlib.suppress(Exception):
            ray.kill(store, no_restart=True)
    if proxy is not None:
        proxy.close()
    if owns_ray:
        # No `serve.shutdown()` first: its controller kills itself while its own graceful-shutdown task
        # is pending, and the raylet prints that task's failure at every job's end. Stopping the
        # private Ray ends the controller and its HTTP proxy with every other process.
        ray.shutdown()
