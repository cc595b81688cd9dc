"""Run one sandboxed command to its end: start it as the execution's uid, watch it, end its whole tree.

`supervise` starts the command (through the rlimit wrapper) in its own session, polls its
processes' count, resident memory and the disk its folders use, and ends the whole tree
(`sandbox.kill_all`) on exit, on timeout or when a limit is passed. Used for the harness and for
evaluator commands alike.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gyre_ray.agents.sandbox import (
    Identity,
    Limits,
    disk_mb,
    grant_runtime,
    kill_all,
    limited_command,
    processes_of,
    resident_mb,
)

POLL_S = 0.2


@dataclass(frozen=True)
class Finished:
    """How a supervised command ended: exit code (None when killed by us), timeout, limit passed."""

    exit_code: int | None
    timed_out: bool
    limit: str  # '' or e.g. "memory limit (4096 MiB)"
    duration_s: float
    leftovers: bool  # processes survived the kill (should not happen)


def _over_limit(identity: Identity, session: int, limits: Limits) -> str:
    pids = processes_of(identity, session)
    if limits.max_processes and len(pids) >= limits.max_processes:  # at the rlimit: a runaway
        return f"process limit ({limits.max_processes})"
    if limits.max_memory_mb and resident_mb(pids) > limits.max_memory_mb:
        return f"memory limit ({limits.max_memory_mb} MiB)"
    return ""


class _DiskWatch:
    """Disk the command adds to the folders (over what they held when it started: seeds, or what a
    harness left for its evaluator), checked often while walking them is cheap, rarer where costly."""

    def __init__(self, folders: list[Path], limit_mb: int) -> None:
        self.folders, self.limit_mb, self.next_at = folders, limit_mb, 0.0
        self.baseline = disk_mb(folders) if limit_mb else 0.0

    def over(self, now: float) -> str:
        if not self.limit_mb or now < self.next_at:
            return ""
        used = disk_mb(self.folders) - self.baseline
        self.next_at = now + max(POLL_S, 20 * (time.monotonic() - now))
        return f"disk limit ({self.limit_mb} MiB)" if used > self.limit_mb else ""


def supervise(
    command: list[str],
    *,
    identity: Identity,
    cwd: Path,
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    limits: Limits,
    watch: list[Path],
) -> Finished:
    """Run `command` until it exits, `timeout_s` passes or a limit is passed; its tree ends with it."""
    start = time.monotonic()
    timed_out, limit = False, ""
    grant_runtime(identity, command)
    user = {"user": identity.uid, "group": identity.gid, "extra_groups": []} if identity.dedicated else {}
    log_fd = os.open(
        log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600
    )  # the job's, not theirs
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen(
            limited_command(command, limits, identity.dedicated),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **user,
        )
    disk = _DiskWatch(watch, limits.max_disk_mb)
    while proc.poll() is None:
        now = time.monotonic()
        if now - start > timeout_s:
            timed_out = True
            break
        limit = _over_limit(identity, proc.pid, limits) or disk.over(now)
        if limit:
            break
        time.sleep(POLL_S)
    clean = kill_all(identity, proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    killed = timed_out or bool(limit)
    return Finished(
        exit_code=None if killed else proc.returncode,
        timed_out=timed_out,
        limit=limit,
        duration_s=time.monotonic() - start,
        leftovers=not clean,
    )
