"""A persistent Ray cluster for a test: `ray start --head` on this machine, stopped by the test alone.

    with ray_head(num_cpus=4) as address:   # RAY_ADDRESS for the drivers the test starts
        ...

The head runs with its own `--temp-dir` (a short folder under /tmp: Ray's socket paths must stay
short) and free ports, so it shares nothing with other Ray instances on the machine. `ray stop`
would stop every Ray here; instead the processes whose command line names that temp dir (its GCS,
raylet, agents and every worker, detached actors' included) are ended by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gyre_ray.ports import free_port

START_ATTEMPTS = 3  # a raylet on a loaded machine can miss Ray's start-up wait


def cluster_env(address: str) -> dict[str, str]:
    """The environment of a driver that joins the cluster at `address`."""
    return {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}


@contextlib.contextmanager
def ray_head(num_cpus: int = 4) -> Iterator[str]:
    """Start a Ray head (its GCS address is yielded); end its processes afterwards."""
    temp = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0",
        "--disable-usage-stats", f"--temp-dir={temp}", "--include-dashboard=false",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}", "--node-ip-address=127.0.0.1",
    ]  # fmt: skip
    env = cluster_env("")
    del env["RAY_ADDRESS"]
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            if started.returncode == 0:
                break
            stop_processes(str(temp))
            if attempt == START_ATTEMPTS:
                raise RuntimeError(f"ray start failed {attempt} times: {started.stderr[-2000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes(str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def processes_naming(text: str) -> list[int]:
    """Pids of this machine's processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def stop_processes(text: str, grace_s: float = 10.0) -> None:
    """SIGTERM the processes naming `text`, then SIGKILL those left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = processes_naming(text)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = processes_naming(text)
