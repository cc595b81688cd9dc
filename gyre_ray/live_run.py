"""A run that outlives its driver: on a persistent Ray cluster, `gyre-ray train --attach RUN_DIR`.

On a cluster that outlives the driver (RAY_ADDRESS names it, as under `ray job submit`) the train job
starts every actor of its runtime detached (the cells and their placement group, the store, the
Serve proxy, the scheduler and `workers`) and writes `live-run.json` into the run folder: the run's
Ray namespace, its proxy, the arguments of the scheduler's `run` call and where the segment started.
When the driver process dies (SIGKILL, its node lost, its session closed) the scheduler actor goes
on with the run: executions keep running, records keep landing in the store, steps keep training.
`gyre-ray train --attach RUN_DIR` reads the file, finds the actors by name and waits for the run
through the scheduler's `join` (`gyre_ray.runtime.run_keeper`); `gyre_ray.train` then streams the
steps metrics.jsonl does not hold yet, ends the run as the first driver would have (trace, costs,
checkpoint, summary, report), shuts the actors down and removes the file. A driver that ends any
other way (the run done, an exception, Ctrl-C, the SIGTERM of `ray job stop`, which `ray.init`'s
handler turns into `sys.exit`) shuts them down itself.
A private local Ray (no RAY_ADDRESS) dies with its driver: nothing is detached there; `--resume`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_ray.config import ConfigError, GyreConfig
from gyre_ray.proxy.store_files import json_lines
from gyre_ray.run_folder import replace_jsonl, replace_text

LIVE_FILE = "live-run.json"
# Every run's driver, local or not, while it runs: {"pid", "host"} (`gyre-ray runs` says `running`;
# a `--resume` of the folder is refused while that driver lives). Left behind by a killed driver.
DRIVER_FILE = "driver.json"


def persistent_cluster() -> bool:
    """True when the driver joins a Ray cluster that outlives it (RAY_ADDRESS names one)."""
    address = os.environ.get("RAY_ADDRESS", "")
    return bool(address) and address != "local"


@dataclass
class LiveRun:
    """A run found alive: its runtime (reconnected), the segment it is in and how far the log got."""

    runtime: Any
    start: tuple[Path | None, int, float] | None  # (checkpoint, first step, offset); None: a new run
    restarts: list[dict[str, Any]]  # core restarts before it (the summary's `core_restarts`)
    logged: int  # steps of the segment already in metrics.jsonl


def record(
    run_dir: Path, runtime: Any, start: tuple[Path | None, int, float] | None, restarts: list[dict[str, Any]]
) -> None:
    """Write `live-run.json` (owner-only: it holds the proxy's admin token) before the run is started.
    `start` and `restarts` are `_run_segment`'s (the segment's start; the core restarts before it)."""
    cfg, proxy = runtime.config, runtime.proxy
    checkpoint, first_step, offset = start or (None, 0, 0.0)
    segment = {
        "checkpoint": str(checkpoint) if checkpoint else None,
        "first_step": first_step,
        "offset": offset,
    }
    info = {
        "namespace": runtime.namespace,
        "app_name": runtime.app_name,
        "core_id": runtime.core_id,
        "proxy": {
            "base_url": proxy.base_url, "admin_token": proxy.admin_token, "serve_url": proxy.serve_url,
            "records_dir": proxy.records_dir, "cell_ids": proxy.cell_ids,
        },
        "run": {"steps": cfg.run.steps, "first_step": first_step, "checkpoint_every": cfg.run.checkpoint_every},
        "segment": segment if start is not None else None,
        "core_restarts": restarts,
        "ray_address": os.environ.get("RAY_ADDRESS", ""),
    }  # fmt: skip
    _write(run_dir, info)


def forget(run_dir: Path) -> None:
    """The run's actors are gone: remove `live-run.json`."""
    (run_dir / LIVE_FILE).unlink(missing_ok=True)


def read(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / LIVE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def attach(cfg: GyreConfig, run_dir: Path) -> LiveRun:
    """Reconnect to the run alive in `run_dir` (module docstring); a `ConfigError` says why not."""
    import ray

    from gyre_ray.proxy.launch import ProxyHandle
    from gyre_ray.runtime.cluster import SCHEDULER_NAME, STORE_NAME, Runtime, connect_ray
    from gyre_ray.runtime.runners import WORKERS_NAME, runner_name

    info = read(run_dir)
    resume = f"`gyre-ray train --resume {run_dir}` continues it from its newest checkpoint"
    if info is None:
        raise ConfigError(
            f"{run_dir} holds no live run ({LIVE_FILE} absent: the run ended, or its driver ran on a "
            f"private local Ray, which died with it); {resume}"
        )
    if not persistent_cluster():
        raise ConfigError(
            f"--attach joins the Ray cluster the run runs on: set RAY_ADDRESS (the run's driver had "
            f"RAY_ADDRESS={info['ray_address'] or '(unset)'})"
        )
    _refuse_live_driver(info)
    run = cfg.run
    if (run.steps, run.checkpoint_every) != (info["run"]["steps"], info["run"]["checkpoint_every"]):
        raise ConfigError(f"{run_dir}/config.json no longer matches the live run ({info['run']})")
    owns_ray = connect_ray(cfg)
    namespace = info["namespace"]
    found = {name: _named(name, namespace) for name in (SCHEDULER_NAME, STORE_NAME, WORKERS_NAME)}
    missing = [name for name, actor in found.items() if actor is None]
    if missing:
        forget(run_dir)
        raise ConfigError(
            f"nothing of the run in {run_dir} is alive on the Ray cluster (no {', '.join(missing)} actor in "
            f"namespace {namespace}); {resume}"
        )
    scheduler = found[SCHEDULER_NAME]
    pool = ray.get(scheduler.cell_pool.remote(), timeout=120)
    p = info["proxy"]
    proxy = ProxyHandle(
        p["base_url"], p["admin_token"], p["cell_ids"], p["records_dir"], info["app_name"], p["serve_url"]
    )
    runtime = Runtime(
        cfg, namespace, pool, found[STORE_NAME], proxy, info["core_id"], scheduler=scheduler,
        workers=found[WORKERS_NAME], owns_ray=owns_ray, app_name=info["app_name"], detached=True,
        runners=[a for i in range(cfg.agents.runners) if (a := _named(runner_name(i), namespace)) is not None],
    )  # fmt: skip
    proxy.owner = runtime
    _write(run_dir, info)  # this driver's pid from now on
    segment, start = info["segment"], None
    if segment is not None:
        checkpoint = Path(segment["checkpoint"]) if segment["checkpoint"] else None
        start = (checkpoint, int(segment["first_step"]), float(segment["offset"]))
    first_step = int(info["run"]["first_step"])
    return LiveRun(runtime, start, info["core_restarts"], logged_steps(run_dir, first_step))


def refuse_if_alive(cfg: GyreConfig, run_dir: Path) -> None:
    """For `--resume`: a `ConfigError` when the run in `run_dir` is still alive (attach instead); a
    `live-run.json` nothing answers for any more is removed."""
    import ray

    from gyre_ray.runtime.cluster import SCHEDULER_NAME, connect_ray

    info = read(run_dir)
    if info is None:
        return
    recorded = info.get("ray_address") or ""
    if recorded and recorded != "local" and not persistent_cluster():
        # it ran on a cluster this process does not join: whether it lives there cannot be told from
        # here, and a local resume beside a live run would write into its folder with it
        raise ConfigError(
            f"the run in {run_dir} ran on the Ray cluster at {recorded} (live-run.json): resume it with "
            f"RAY_ADDRESS={recorded} set, or `gyre-ray train --attach {run_dir}` there"
        )
    if persistent_cluster():
        started = connect_ray(cfg)
        alive = _named(SCHEDULER_NAME, info["namespace"]) is not None
        if started:
            ray.shutdown()  # the run's own start connects again, as it would have
        if alive:
            raise ConfigError(
                f"the run in {run_dir} is still alive on the Ray cluster (namespace {info['namespace']}; "
                f"its driver died?): `gyre-ray train --attach {run_dir}` takes it over and finishes it"
            )
    forget(run_dir)


def logged_steps(run_dir: Path, first_step: int) -> int:
    """How many steps from `first_step` on metrics.jsonl holds; a line torn by the dead driver is cut off."""
    path = run_dir / "metrics.jsonl"
    rows = list(json_lines(path))
    if path.is_file():
        replace_jsonl(path, rows)
    return sum(1 for row in rows if int(row["step"]) >= first_step)


def _named(name: str, namespace: str) -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def driver_state(driver: Any) -> str:
    """Whether the driver `live-run.json` names still runs: `running` or `gone` when it ran on this
    host (its pid looked up in /proc), `elsewhere` when it ran on another host (nothing here can tell)."""
    if not isinstance(driver, dict) or driver.get("host") != socket.gethostname():
        return "elsewhere"
    cmdline = Path(f"/proc/{driver.get('pid')}/cmdline")
    try:
        alive = b"train" in cmdline.read_bytes()  # a reused pid runs something else
    except OSError:
        alive = False
    return "running" if alive else "gone"


def mark_driver(run_dir: Path) -> None:
    """Write `driver.json`: this process drives the run in `run_dir` (`clear_driver` at its end)."""
    replace_text(run_dir / DRIVER_FILE, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def clear_driver(run_dir: Path) -> None:
    """The run's driver is ending: remove its `driver.json` (only its own)."""
    driver = recorded_driver(run_dir)
    if driver is not None and driver.get("pid") == os.getpid():
        (run_dir / DRIVER_FILE).unlink(missing_ok=True)


def recorded_driver(run_dir: Path) -> dict[str, Any] | None:
    """`driver.json`'s driver, None when there is none (or it cannot be read)."""
    try:
        driver = json.loads((run_dir / DRIVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return driver if isinstance(driver, dict) else None


def refuse_running_driver(run_dir: Path) -> None:
    """For `--resume`: a `ConfigError` while another driver of this host still runs the run (local
    runs have no live-run.json; two drivers would write into one folder)."""
    driver = recorded_driver(run_dir)
    if driver is not None and driver.get("pid") != os.getpid() and driver_state(driver) == "running":
        raise ConfigError(
            f"the run in {run_dir} is still running: its driver (pid {driver['pid']}) runs on this host; "
            "stop it or let it finish, then resume"
        )


def _refuse_live_driver(info: dict[str, Any]) -> None:
    """Two drivers of one run would both end it: refuse while the recorded one runs on this host."""
    driver = info.get("driver", {})
    if driver.get("pid") != os.getpid() and driver_state(driver) == "running":
        raise ConfigError(
            f"the run's driver (pid {driver['pid']}) still runs on this host: it is not dead; stop it or "
            "let it finish"
        )


def _write(run_dir: Path, info: dict[str, Any]) -> None:
    info = {**info, "driver": {"pid": os.getpid(), "host": socket.gethostname()}}
    path = run_dir / LIVE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    # created owner-only: never readable by others, not even before a chmod
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(json.dumps(info, indent=2))
    tmp.replace(path)
