"""Run one sandboxed command to its end: start it as the execution's uid, watch it, end its whole tree.

`supervise` starts the command (through the rlimit wrapper) in its own session, polls its
processes' count, resident memory and the disk its folders use (with a uid of its own, also what the
uid writes in the machine's shared scratch folders, and its memory held by no process: tmpfs files,
detached SysV shared memory), and ends the whole tree
(`sandbox.kill_all`) on exit, on timeout or when a limit is passed. Used for the harness and for
evaluator commands alike.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_ray.agents.limits import needed_paths, private_scratch
from gyre_ray.agents.sandbox import (
    Identity,
    Limits,
    disk_mb,
    grant_runtime,
    kill_all,
    limited_command,
    private_mounts_work,
    processes_of,
    resident_mb,
)
from gyre_ray.agents.scratch import detached_shm_mb, scratch_roots, scratch_usage

POLL_S = 0.2
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """How a supervised command ended: exit code (None when killed by us), timeout, limit passed."""

    exit_code: int | None
    timed_out: bool
    limit: str  # '' or e.g. "memory limit (4096 MiB)"
    duration_s: float
    leftovers: bool  # processes survived the kill (should not happen)


def _over_limit(identity: Identity, session: int, limits: Limits, outside_mb: float = 0.0) -> str:
    """`outside_mb`: memory the execution holds outside its processes (`_DiskWatch.ram_mb`)."""
    pids = processes_of(identity, session)
    if limits.max_processes and len(pids) >= limits.max_processes:  # at the rlimit: a runaway
        return f"process limit ({limits.max_processes})"
    if limits.max_memory_mb and resident_mb(pids) + outside_mb > limits.max_memory_mb:
        return f"memory limit ({limits.max_memory_mb} MiB)"
    return ""


class _Usage:
    """One measure, (disk MiB, of which memory MiB), over what it gave when the watch began. Taken again
    in a thread of its own, so a slow walk (a busy shared /tmp: 0.5 s and more under load) never holds
    up the other measures or the memory and process checks: often while cheap, rarer where costly (it
    waits 20 times what the last one took). A measure that fails (part of a tree the execution wrote
    could not be read) counts as over the disk limit (`failed`): what it could not read, it could fill;
    the watch goes on either way (a thread ended by an error would leave the limit unchecked)."""

    def __init__(self, measure: Callable[[], tuple[float, float]]) -> None:
        self.measure, self.added, self.failed = measure, (0.0, 0.0), False
        self.baseline = self._take() or (0.0, 0.0)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="gyre-disk-watch", daemon=True)

    def _take(self) -> tuple[float, float] | None:
        """One measure, or None when it failed (then `failed`, and `added` is over any disk limit)."""
        try:
            measured = self.measure()
        except Exception as exc:  # (any: RecursionError, OSError, ...)
            if not self.failed:
                log.warning("disk use could not be measured: %s: %s", type(exc).__name__, exc)
            self.failed, self.added = True, (math.inf, self.added[1])
            return None
        self.failed = False
        return measured

    def _watch(self) -> None:
        while not self.stopped.is_set():
            start = time.monotonic()
            measured = self._take()
            if measured is not None:
                disk, ram = measured
                self.added = (max(0.0, disk - self.baseline[0]), max(0.0, ram - self.baseline[1]))
            self.stopped.wait(max(POLL_S, 20 * (time.monotonic() - start)))


class _DiskWatch:
    """Disk the command adds (over what was there when it started: seeds, or what a harness left for its
    evaluator) to its folders and, with a uid of its own, to the machine's shared scratch folders (the
    files its uid owns under each of the `shared` scratch roots, its own folders there not counted twice; each
    root measured in a thread of its own, so a busy /tmp does not slow the watch of /dev/shm or of the
    workspace). `ram_mb`: what it added that is memory of no process (its files
    on tmpfs such as /dev/shm, its SysV shared memory no process has attached), for the memory limit."""

    def __init__(
        self,
        folders: list[Path],
        limit_mb: int,
        identity: Identity,
        memory_mb: int = 0,
        shared: tuple[str, ...] = (),
    ) -> None:
        self.limit_mb, self.ram_mb = limit_mb, 0.0
        self.parts = [_Usage(lambda: (disk_mb(folders), 0.0))] if limit_mb else []
        self.identity = identity if identity.dedicated and (limit_mb or memory_mb) else None
        self.own = tuple(os.path.realpath(folder) for folder in folders)  # under a shared /tmp: counted once
        self.watch_shared(shared)
        if self.identity is not None and memory_mb:  # (what it gives counts toward the memory limit only)
            self.parts.append(_Usage(lambda uid=identity.uid: (0.0, detached_shm_mb(uid))))

    def watch_shared(self, roots: tuple[str, ...]) -> None:
        """Also measure what the uid owns under these shared scratch roots (before `start`; nothing
        without a uid of its own)."""
        if self.identity is None:
            return
        uid, gid, own = self.identity.uid, self.identity.gid, self.own
        self.parts += [_Usage(lambda r=root: scratch_usage(uid, gid, (r,), skip=own)) for root in roots]

    def start(self) -> None:
        for part in self.parts:
            part.thread.start()

    def stop(self) -> None:
        """The threads end after the measure under way (not waited for: the watch's answer is no longer read)."""
        for part in self.parts:
            part.stopped.set()

    def over(self) -> str:
        """The disk limit passed, by the latest measure of each part ('' when not)."""
        self.ram_mb = sum(part.added[1] for part in self.parts)
        used = sum(part.added[0] for part in self.parts)
        if not self.limit_mb or used <= self.limit_mb:
            return ""
        unmeasured = any(part.failed for part in self.parts)
        return f"disk limit ({self.limit_mb} MiB)" + (": its use could not be measured" if unmeasured else "")


def _read_report(report: socket.socket, timeout_s: float) -> str:
    """The line the limits wrapper says before the command starts ('ok': its private mounts are in
    place; 'shared': one failed, and it waits for a go), or '' when it ends or `timeout_s` passes first."""
    report.settimeout(timeout_s)
    said = b""
    with contextlib.suppress(OSError):  # (a timeout, or a wrapper that failed and closed it)
        while not said.endswith(b"\n") and (chunk := report.recv(64)):
            said += chunk
    return said.decode(errors="replace").strip()


def open_log(path: Path) -> int:
    """`path` opened to append (created 0600): never through a link, never a FIFO or device the
    execution put there in its folder (the job would block on it or write into it as root)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _shared_scratch(
    command: list[str], identity: Identity, cwd: Path, env: dict[str, str], watch: list[Path]
) -> tuple[str, ...]:
    """The scratch roots the command will share with the machine (the wrapper gives the others a private
    tmpfs, bounded by its size, that needs no walk); () without a uid of its own."""
    if not identity.dedicated:
        return ()
    needed = needed_paths(command, str(cwd), env, folders=[str(folder) for folder in watch])
    private = private_scratch(needed) if private_mounts_work() else []
    return tuple(root for root in scratch_roots() if root not in private)


def _start(
    command: list[str],
    limits: Limits,
    identity: Identity,
    cwd: Path,
    env: dict[str, str],
    log_path: Path,
    watch: list[Path],
    when_shared: Callable[[], None],
) -> subprocess.Popen:
    """`command` started behind the limits wrapper in a session of its own, its output to `log_path`.
    With a uid of its own, where the wrapper does not report its private mounts in place,
    `when_shared` runs before the wrapper goes on to start the command."""
    log_fd = open_log(log_path)
    report, report_w = socket.socketpair() if identity.dedicated else (None, None)
    with os.fdopen(log_fd, "ab") as log:
        try:
            proc = subprocess.Popen(
                limited_command(
                    command,
                    limits,
                    identity,
                    cwd,
                    None if report_w is None else report_w.fileno(),
                    own=tuple(watch),
                ),
                cwd="/",  # (it becomes the uid, then enters cwd)
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=() if report_w is None else (report_w.fileno(),),
            )
        except BaseException:
            if report is not None:
                report.close()
            raise
        finally:
            if report_w is not None:
                report_w.close()
    if report is not None:
        with report:
            if _read_report(report, timeout_s=30.0) != "ok":
                when_shared()
                with contextlib.suppress(OSError):
                    report.sendall(b"g")
    return proc


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
    shared = _shared_scratch(command, identity, cwd, env, watch)
    identity.shared_scratch.update(shared)  # what `reclaim` sweeps
    disk = _DiskWatch(
        watch, limits.max_disk_mb, identity, limits.max_memory_mb, shared
    )  # before it can write

    def when_shared() -> None:  # its private mounts failed: every scratch folder is shared
        late = tuple(root for root in scratch_roots() if root not in shared)
        identity.shared_scratch.update(late)
        disk.watch_shared(late)

    proc = _start(command, limits, identity, cwd, env, log_path, watch, when_shared)
    disk.start()
    try:
        while proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            limit = _over_limit(identity, proc.pid, limits, disk.ram_mb) or disk.over()
            if limit:
                break
            time.sleep(POLL_S)
    finally:
        disk.stop()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # its group, as root: also a wrapper
        os.killpg(proc.pid, signal.SIGKILL)  # still root (not yet the uid, which kill_all kills as)
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
