"""Isolation for harness processes: their own unprivileged user, folders, environment and limits.

An execution runs untrusted code (the agent under training, and whatever it writes). Its sandbox:

- **Its own uid** where the job runs as root (`isolation: auto` or `user`): a pool of system users
  `gyre-exec-<slot>` is created on demand with `useradd`; a slot is held with an exclusive `flock`
  for the whole execution, so no two running executions share a uid. Without root (or without
  `useradd`) `auto` falls back to the job's own uid (`none`): limits and the environment allowlist
  still apply, but another execution's files are then protected only by the path being unknown.
- **Its own folders**: workspace, HOME and TMPDIR, owned by its uid, mode 0700; ancestors of the
  workspace get `o+x` (traverse, never list) so the uid can reach them. When the execution ends
  its folders are handed back to the job's uid (closed 0700; each on its own, at any depth and path
  length). The slot's lock file names each folder before the uid gets it: where the executor died
  (or a hand-back failed) the slot's next holder hands them back before anything runs as the uid.
  Its shared scratch folders (/tmp, /var/tmp, /dev/shm, /run/lock, ...: `scratch_roots`) and SysV
  IPC are its own: the limits wrapper mounts a private tmpfs over them (one, `agents.max_disk_mb` in
  size) in a mount and IPC namespace of its own, gone with its last process. Where the host refuses that, what its uid left in those folders and
  its SysV IPC objects are removed at reclaim, so the next execution that draws the same uid can
  read none of it.
- **An environment allowlist** (`harness_env`): PATH, locale, HOME/TMPDIR, the proxy's URLs and the
  execution's own key, and the variables a config names; never the job's secrets.
- **Limits** (`gyre_ray.agents.limits` applies rlimits in the child; `supervise` watches the rest).
- **Kill of the whole tree** (`kill_all`): with its own uid, `kill(-1, SIGKILL)` issued as that uid
  until /proc shows none of its processes (this also ends children that left the session);
  otherwise the harness's session.
"""

from __future__ import annotations

import fcntl
import functools
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre_ray.agents import limits as limits_module
from gyre_ray.agents.config import WORKSPACES_DIR
from gyre_ray.agents.scratch import DIR_FLAGS, allocated, remove_ipc, remove_scratch, tree_entries, walk_tree

USER_PREFIX = "gyre-exec-"
GROUP = "gyre-exec"  # the pool users' shared primary group: may traverse what they need to reach
LOCK_DIR = Path(os.environ.get("GYRE_SANDBOX_LOCK_DIR", "/tmp/gyre-ray-sandbox"))
LIMITS_SCRIPT = str(Path(limits_module.__file__).resolve())  # run by path: see limited_command
log = logging.getLogger(__name__)
BASE_ENV_NAMES = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


class SandboxError(RuntimeError):
    """The sandbox could not be set up (e.g. `isolation: user` without root)."""


@dataclass(frozen=True)
class Limits:
    """Per-execution resource limits (0 disables one)."""

    max_processes: int = 256
    max_memory_mb: int = 4096
    max_file_mb: int = 1024
    max_disk_mb: int = 4096  # as `agents.max_disk_mb`


@dataclass
class Identity:
    """Who the harness runs as: a pool user (with the flock that reserves it) or the job's own uid."""

    uid: int
    gid: int
    name: str
    dedicated: bool
    lock_fd: int | None = None
    folders: list[Path] = field(default_factory=list)
    # the scratch roots its commands found shared (not given a private tmpfs): what `reclaim` sweeps
    shared_scratch: set[str] = field(default_factory=set)

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def can_create_users() -> bool:
    """Root with `useradd` on PATH (the conditions for a uid per execution)."""
    return os.geteuid() == 0 and shutil.which("useradd") is not None


def _run_admin(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SandboxError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")


def _ensure_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_DIR / "useradd.lock", "w") as lock:  # useradd itself fails on a concurrent lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
        try:
            grp.getgrnam(GROUP)
        except KeyError:
            _run_admin(["groupadd", "--system", GROUP])
        _run_admin(
            ["useradd", "--system", "--gid", GROUP, "--no-create-home", "--shell", "/usr/sbin/nologin", name]
        )
    return pwd.getpwnam(name)


def own_uids(isolation: str) -> bool:
    """Whether `isolation` gives each execution a uid of its own here (`user`, or `auto` with root and
    useradd)."""
    return isolation == "user" or (isolation == "auto" and can_create_users())


def acquire_identity(isolation: str) -> Identity:
    """An identity for one execution. `user`: a pool uid (error without root); `auto`: a pool uid where
    possible, else the job's; `none`: the job's uid."""
    if isolation not in ("auto", "user", "none"):
        raise ValueError(f"isolation must be auto, user or none, got {isolation!r}")
    if not own_uids(isolation):
        me = pwd.getpwuid(os.geteuid())
        return Identity(os.geteuid(), os.getegid(), me.pw_name, dedicated=False)
    if not can_create_users():
        raise SandboxError("isolation 'user' needs root and useradd; use isolation 'auto' or 'none'")
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(LOCK_DIR, 0o700)
    for slot in range(4096):
        fd = os.open(LOCK_DIR / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            entry = _ensure_user(f"{USER_PREFIX}{slot}")
        except BaseException:
            os.close(fd)
            raise
        identity = Identity(entry.pw_uid, entry.pw_gid, entry.pw_name, dedicated=True, lock_fd=fd)
        try:
            kill_all(identity, None)  # anything a crashed earlier holder left behind
            # marked held, never reclaimed (its executor died, or its reclaim failed): before anything
            # runs as the uid, its folders go back to the job and what it left elsewhere is removed
            if os.fstat(fd).st_size and not _sweep_slot(identity):
                log.warning("sandbox slot %s: what its last holder left could not all be taken back from %s; "
                            "skipped (it stays marked for the next holder)", slot, identity.name)  # fmt: skip
                os.close(fd)
                continue
            _mark_held(identity)  # cleared by `reclaim` once the slot is clean again
        except BaseException:
            os.close(fd)
            raise
        return identity
    raise SandboxError("no free sandbox user slot")


def _mark_held(identity: Identity) -> None:
    """Mark the identity's slot held in its lock file, with the paths of the folders given to its uid so
    far (`prepare_folders` adds each before handing it over): a holder that dies without `reclaim` leaves
    the next holder the folders to take back. A line "held", then one JSON string per folder."""
    if identity.lock_fd is None:
        return
    lines = [b"held", *(json.dumps(os.path.abspath(folder)).encode() for folder in identity.folders)]
    record = b"\n".join(lines) + b"\n"
    os.pwrite(identity.lock_fd, record, 0)  # (written first: cut short, no moment shows the slot clean)
    os.ftruncate(identity.lock_fd, len(record))


def _recorded_folders(fd: int) -> list[Path]:
    """The folders a slot's lock file names (`_mark_held`); unreadable lines are skipped."""
    size = os.fstat(fd).st_size
    folders = []
    for line in os.pread(fd, min(size, 1 << 20), 0).split(b"\n")[1:]:
        try:
            named = json.loads(line)
        except ValueError:
            continue
        if isinstance(named, str) and os.path.isabs(named):
            folders.append(Path(named))
    return folders


def _sweep_slot(identity: Identity) -> bool:
    """What the slot's last holder, never reclaimed, left to its uid: the folders its lock file names
    handed back to the job (only what the uid owns there: the path may be another execution's by now),
    what the uid owns in every shared scratch folder and its SysV IPC objects removed. Whether all went."""
    assert identity.lock_fd is not None
    return _take_back(identity, _recorded_folders(identity.lock_fd), None, only_uid=identity.uid)


def _take_back(
    identity: Identity, folders: list[Path], roots: tuple[str, ...] | None, only_uid: int | None = None
) -> bool:
    """`folders` handed back (each on its own, past one that fails), what `identity`'s uid owns in the
    scratch `roots` (None: all; (): none) and its SysV IPC objects removed; whether all went."""
    clean = True
    for folder in _outermost(folders):
        clean = _hand_back_logged(folder, identity, only_uid) and clean
    try:
        if roots != ():
            remove_scratch(identity.uid, roots, identity.gid)
        remove_ipc(identity.uid)
    except Exception as exc:  # (an unexpected error: the slot is not known clean)
        log.warning("sweeping what %s left failed: %s: %s", identity.name, type(exc).__name__, exc)
        clean = False
    return clean


def reap_orphans() -> list[str]:
    """End the processes of every pool user whose slot nobody holds; returns those users.

    A slot's flock lives in the process that runs the execution (`workers` or a runner actor), and
    goes with it when that process dies, while its harness, in a session of its own, runs on: its
    calls are refused (its key revoked) but its tools go on using the node. Such a harness is ended
    here (an executor calls this as it starts: after Ray restarts one) rather than when the slot is
    next drawn. What the holder left, its folders (named in the slot's lock file) and in shared scratch
    folders, stays until then (the slot is still marked held: `acquire_identity` takes it all back
    before anything runs as the uid), as that walk is slow. Nothing without root, or before the pool
    exists."""
    if os.geteuid() != 0 or not LOCK_DIR.is_dir():
        return []
    running = _uids_with_processes()
    reaped = []
    for path in sorted(LOCK_DIR.glob("slot-*.lock")):
        name = USER_PREFIX + path.name.removeprefix("slot-").removesuffix(".lock")
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        if entry.pw_uid not in running:
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: its execution is alive
            kill_all(Identity(entry.pw_uid, entry.pw_gid, name, dedicated=True), None)
            reaped.append(name)
        finally:
            os.close(fd)  # (and with it the flock)
    return reaped


def _uids_with_processes() -> set[int]:
    """The owners of the live processes (one read of /proc)."""
    uids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uids.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                continue
    return uids


def grant_traverse(path: Path, gid: int) -> None:
    """Let the pool group traverse (never list) every ancestor of `path` that blocks other users: an
    ancestor with no group or other access and owned by the job gets group `gid` with `g+x` only."""
    for parent in reversed(Path(path).resolve().parents):
        st = parent.stat()
        if st.st_mode & 0o001 or (st.st_gid == gid and st.st_mode & 0o010):
            continue
        if st.st_uid != os.geteuid() or st.st_mode & 0o070:
            raise SandboxError(
                f"{parent} is not traversable by sandbox users and not ours to open (mode {st.st_mode:o})"
            )
        os.chown(parent, -1, gid)
        os.chmod(parent, (st.st_mode & 0o7707) | 0o010)


def grant_runtime(identity: Identity, command: list[str]) -> None:
    """Let the identity reach the interpreter the wrapper needs and the command's executable (one in
    its own folders, e.g. `{workspace}/run.sh` or an evaluator's `{hidden}/judge.sh`, it reaches already)."""
    if not identity.dedicated:
        return
    needed = [Path(sys.executable).resolve(), Path(sys.base_prefix) / "lib", Path(sys.prefix) / "lib"]
    found = shutil.which(command[0]) if command else None
    # decided on the path as named, links not followed: a program in the execution's own folders it
    # reaches already, and a link it put there must not make the job open what the link points at
    named = Path(os.path.abspath(found)) if found else None
    if named and not any(
        named.is_relative_to(g) for f in identity.folders for g in (Path(os.path.abspath(f)), f.resolve())
    ):
        needed.append(named.resolve())
    for path in needed:
        grant_traverse(path / "x" if path.is_dir() else path, identity.gid)


def prepare_folders(identity: Identity, *folders: Path) -> None:
    """Create `folders` (workspace, HOME, TMPDIR), private to the identity (0700, owned by its uid). Each
    is named in the slot's lock file before its uid gets it (`_mark_held`)."""
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        identity.folders.append(folder)
        if identity.dedicated:
            _mark_held(identity)
            grant_traverse(folder, identity.gid)
            if not _chown_tree(folder, identity.uid, identity.gid):
                raise SandboxError(f"{folder} could not be given to {identity.name} (see the log)")
        os.chmod(folder, 0o700)


def _chown_tree(root: Path, uid: int, gid: int, only_uid: int | None = None) -> bool:
    """Give `root` and everything below it to uid:gid (links themselves, never followed; at any depth and
    path length: `scratch.walk_tree`); with `only_uid`, only what that uid owns. Goes on past an entry
    that fails (logged); returns whether all went."""
    failures: list[OSError] = []

    def wanted(st: os.stat_result) -> bool:
        return (st.st_uid, st.st_gid) != (uid, gid) and only_uid in (None, st.st_uid)

    try:
        if wanted(os.lstat(root)):
            os.chown(root, uid, gid, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError as exc:
        failures.append(exc)
    for fd, name, st, after in walk_tree(root, failures):
        if after or not wanted(st):
            continue
        try:
            os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures.append(exc)
    if failures:
        log.warning("%s: %d entries could not be given to uid %d, the first: %s", root, len(failures), uid,
                    failures[0])  # fmt: skip
    return not failures


def _outermost(folders: list[Path]) -> list[Path]:
    """`folders` without those inside another of them (an evaluator's HOME in its `<id>.eval`): handing
    back the outer one covers them, and never through a folder the uid owned."""
    kept: list[Path] = []
    for folder in sorted({Path(os.path.abspath(f)) for f in folders}, key=lambda f: len(f.parts)):
        if not any(folder.is_relative_to(outer) for outer in kept):
            kept.append(folder)
    return kept


def _hand_back(folder: Path, only_uid: int | None = None) -> bool:
    """One of the execution's folders back to the job's uid (with `only_uid`, what that uid owns in it),
    closed to everyone else (0700) where it was the execution's (the uid may have opened it: what lies in
    it, hidden tests copied for the judge included, stays the job's alone). Whether all went."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):  # (never: the folders lie in the job's own)
        if only_uid in (None, st.st_uid):
            os.chown(folder, os.geteuid(), os.getegid(), follow_symlinks=False)
        return True
    done = _chown_tree(folder, os.geteuid(), os.getegid(), only_uid)
    if only_uid in (None, st.st_uid):
        fd = os.open(folder, DIR_FLAGS)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    return done


def _hand_back_logged(folder: Path, identity: Identity, only_uid: int | None = None) -> bool:
    """`_hand_back`, any error logged and taken as not all done."""
    try:
        return _hand_back(folder, only_uid)
    except Exception as exc:
        log.warning(
            "%s could not be taken back from %s: %s: %s", folder, identity.name, type(exc).__name__, exc
        )
        return False


def reclaim(identity: Identity) -> None:
    """After the execution: its folders back to the job's uid, what its uid left in the scratch folders
    its commands shared (those its private tmpfs served are gone with it) and its SysV IPC objects
    removed, its slot freed. Never raises for what the execution left: each folder is handed back on its
    own, past one that fails; where anything failed the slot stays marked held, with its folders named,
    and the next holder sweeps it all again before anything runs (`acquire_identity`)."""
    try:
        if identity.dedicated:
            # only the scratch folders its commands shared (walking a busy /tmp took 0.5 s of CPU)
            clean = _take_back(identity, identity.folders, tuple(sorted(identity.shared_scratch)))
            if clean and identity.lock_fd is not None:
                os.ftruncate(identity.lock_fd, 0)  # clean: the next holder need not search again
            elif not clean:
                log.warning("%s: not all it left could be taken back; its slot stays marked for the next "
                            "holder to sweep", identity.name)  # fmt: skip
    finally:
        identity.release()


def harness_env(
    identity: Identity, home: Path, tmp: Path, values: dict[str, str], passthrough: tuple[str, ...] = ()
) -> dict:
    """The harness's whole environment: an allowlist, never the job's own variables wholesale."""
    env = {name: os.environ[name] for name in (*BASE_ENV_NAMES, *passthrough) if name in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=str(home), TMPDIR=str(tmp), USER=identity.name, LOGNAME=identity.name, SHELL="/bin/bash")
    env["TERM"] = "dumb"
    env.update(values)
    return env


def limited_command(
    command: list[str],
    limits: Limits,
    identity: Identity,
    cwd: Path,
    report_fd: int | None = None,
    own: tuple[Path, ...] = (),
) -> list[str]:
    """`command` behind the rlimit wrapper, run in `cwd`; with a uid of its own the wrapper starts as
    root (isolated: `python -I -S` on the script itself), gives it a private /proc, /tmp and IPC (the
    tmpfs as large as its disk limit, SysV memory bounded by its memory limit), becomes the uid and
    only then enters `cwd` (and only then is the process count, per uid, limited)."""
    wrapper = [sys.executable, "-I", "-S", LIMITS_SCRIPT, "--cwd", str(cwd)]
    if identity.dedicated:
        wrapper += ["--uid", str(identity.uid), "--gid", str(identity.gid)]
        wrapper += ["--scratch-mb", str(limits.max_disk_mb), "--memory-mb", str(limits.max_memory_mb)]
        wrapper += ["--report-fd", str(report_fd)] if report_fd is not None else []
        for folder in own:  # writable in its private scratch where they lie in a shared folder
            wrapper += ["--own", str(folder)]
    wrapper += ["--nproc", str(limits.max_processes if identity.dedicated else 0)]
    wrapper += ["--fsize-mb", str(limits.max_file_mb), "--"]
    return wrapper + list(command)


@functools.cache
def private_mounts_work() -> bool:
    """Whether this host lets the limits wrapper give an execution its private /proc, /tmp and IPC (a
    pod without CAP_SYS_ADMIN does not): tried once per process, as the wrapper would. Where not, the
    shared scratch folders stay shared, and the disk watch walks them all (one warning in the log)."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", LIMITS_SCRIPT, "--probe"], cwd="/", capture_output=True, text=True,
            timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess([], 1, "", repr(exc))
    if done.returncode == 0:
        return True
    why = (done.stdout.strip() or done.stderr.strip())[-300:]
    log.warning("private scratch folders are not available here (%s): executions share /tmp and the like, "
                "whose use the disk watch walks", why)  # fmt: skip
    return False


def processes_of(identity: Identity, session: int | None) -> list[int]:
    """Live pids of the execution: every process of its uid (own uid), or of the harness's session."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if identity.dedicated and os.stat(f"/proc/{entry}").st_uid != identity.uid:
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] in ("Z", "X"):  # exited, waiting to be reaped: holds no resources
                continue
            if identity.dedicated or (session is not None and int(fields[3]) == session):
                pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def resident_mb(pids: list[int]) -> float:
    """Summed resident memory of `pids` in MiB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total / 1024


def disk_mb(folders: list[Path]) -> float:
    """Allocated size of everything under `folders` in MiB (a file linked twice counted once)."""
    seen: set[tuple[int, int]] = set()
    return sum(allocated(st, seen) for folder in folders for st in tree_entries(folder)) / (1 << 20)


def kill_all(identity: Identity, session: int | None, wait_s: float = 10.0) -> bool:
    """SIGKILL every process of the execution; True when none is left."""
    deadline = time.monotonic() + wait_s
    empty_scans = 0
    while True:
        pids = processes_of(identity, session)
        if not pids:
            empty_scans += 1
            if empty_scans == 2:  # a child forked while /proc was being read is seen by the next scan
                return True
            time.sleep(0.05)
            continue
        empty_scans = 0
        if time.monotonic() > deadline:
            return False
        if identity.dedicated:  # as the uid itself: reaches children that left the session too
            subprocess.run(
                [sys.executable, "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"],
                user=identity.uid,
                group=identity.gid,
                extra_groups=[],
                env={},
                capture_output=True,
                timeout=30,
                check=False,
            )
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
        time.sleep(0.05)


def make_private(path: Path) -> None:
    """Close `path` (e.g. a task's hidden tests) to everyone but the job's uid, where it is the job's."""
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, st.st_mode & 0o7700)


def _refuse_if_open_to_others(path: Path) -> None:
    """SandboxError when hidden tests the job does not own (so leaves as they are) can be read by
    other uids: every folder above them lets others through, and they let others in or list them."""
    st = path.stat()
    if st.st_uid == os.geteuid() or not st.st_mode & 0o005:
        return
    if all(parent.stat().st_mode & 0o001 for parent in path.resolve().parents):
        raise SandboxError(
            f"hidden tests {path} are readable by the executions' uids (owned by uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}): the job closes only folders it owns; copy them into a folder "
            "the job owns, or close them (chmod o-rx)"
        )


def close_hidden_tests(hidden: list[Path]) -> list[Path]:
    """Close every task's hidden tests to the sandbox users (not only the running task's), and the git
    repository they sit in, whose objects hold them too; returns the repositories closed. In a linked
    worktree or a submodule `.git` is a file naming the repository (`gitdir:`, and a worktree's
    `commondir`): that repository is closed, and the hidden tests' copies in the repository's other
    checkouts (its main work tree, its other worktrees) too."""
    closed = []
    for path in hidden:
        make_private(path)
        _refuse_if_open_to_others(path)
        resolved = path.resolve()
        for parent in resolved.parents:
            dotgit = parent / ".git"
            if not (dotgit.is_dir() or dotgit.is_file()):
                continue
            repositories = _git_repositories(dotgit)
            for repository in repositories:
                st = repository.stat()
                if st.st_uid == os.geteuid() and st.st_mode & 0o077:
                    make_private(repository)
                    closed.append(repository)
            if repositories:
                for checkout in _git_checkouts(repositories[-1]):
                    copy = checkout / resolved.relative_to(parent)
                    if checkout != parent and not copy.is_symlink() and copy.exists():
                        make_private(copy)
            break
    return closed


def _git_repositories(dotgit: Path) -> list[Path]:
    """The repository folders behind a `.git`: itself when a folder; for a `.git` file the folder its
    `gitdir:` names, then (a linked worktree's) the shared repository its `commondir` names."""
    if dotgit.is_dir():
        return [dotgit]
    try:
        text = dotgit.read_text(errors="replace")[:4096]
    except OSError:
        return []
    named = next((line[7:].strip() for line in text.splitlines() if line.startswith("gitdir:")), "")
    if not named:
        return []
    gitdir = Path(os.path.normpath(dotgit.parent / named))  # relative to the .git file's folder
    if not gitdir.is_dir():
        return []
    repositories = [gitdir]
    try:
        common = (gitdir / "commondir").read_text(errors="replace")[:4096].strip()
    except OSError:
        common = ""
    if common:
        shared = Path(os.path.normpath(gitdir / common))  # relative to the worktree's git folder
        if shared.is_dir() and shared != gitdir:
            repositories.append(shared)
    return repositories


def _git_checkouts(repository: Path) -> list[Path]:
    """Work trees of a repository folder: the main one (the folder holding it as `.git`) and its linked
    worktrees (`worktrees/<name>/gitdir` names each one's `.git` file)."""
    checkouts = [repository.parent] if repository.name == ".git" else []
    try:
        linked = list((repository / "worktrees").iterdir())
    except OSError:
        linked = []
    for folder in linked:
        try:
            named = (folder / "gitdir").read_text(errors="replace")[:4096].strip()
        except OSError:
            continue
        if named:
            checkouts.append(Path(os.path.normpath(folder / named)).parent)
    return checkouts


def protect_ray_credentials(home: Path | None = None) -> None:
    """Ray's token (`~/.ray/auth_token`, or `RAY_AUTH_TOKEN_PATH`) opens the whole cluster to whoever
    reads it; Ray leaves it readable by all (0644). Close it, and `~/.ray`, to the job's uid."""
    home = home or Path.home()
    candidates = [Path(os.environ["RAY_AUTH_TOKEN_PATH"])] if os.environ.get("RAY_AUTH_TOKEN_PATH") else []
    candidates += [home / ".ray" / "auth_token", home / ".ray"]
    for path in candidates:
        try:
            if not path.is_symlink() and path.exists():
                make_private(path)
        except OSError:
            continue


def job_workspaces(workspace: Path) -> Path:
    """The run's workspaces folder above an execution's `workspace`; the folders between it and the
    workspace (an evaluation round's `eval-<step>`) are made traversable but not listable, like it."""
    for depth, folder in enumerate(workspace.parents):
        if folder.name == WORKSPACES_DIR:
            for inner in list(workspace.parents)[:depth]:
                inner.mkdir(parents=True, exist_ok=True)
                os.chmod(inner, 0o711)
            return folder
    return workspace.parent


def secure_workspace_root(root: Path) -> None:
    """`agents.workspace_root` as the job's own: created if missing, and closed to writes by others.

    A Kubernetes emptyDir is created 0777 without the sticky bit: a sandbox uid could then rename the
    run's folder under it and put its own in place (other executions' workspaces, files the job
    writes and chowns as root); such a folder of the job's is closed (0711). A sticky folder (/tmp) is
    left as it is: only an entry's owner may rename it there, and its mode is the machine's. Refused
    (SandboxError), the job root or not: a symbolic link, a folder owned by anyone but the job or root
    (its owner may rename the run's folder, and open the folder again after any chmod), and one others
    may write that is not sticky and not the job's to close."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root, DIR_FLAGS)  # (what is checked is what is changed: never through a link)
    except OSError as exc:
        raise SandboxError(f"agents.workspace_root {root} must be a folder, not a symbolic link") from exc
    try:
        _secure_root(root, fd)
    finally:
        os.close(fd)


def _secure_root(root: Path, fd: int) -> None:
    """`secure_workspace_root`'s checks on the folder open at `fd`."""
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise SandboxError(
            f"agents.workspace_root {root} belongs to uid {st.st_uid}, not to the job (uid {me}): its owner "
            "could replace the run's folders; give the job a folder of its own"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        if st.st_uid != me:
            raise SandboxError(
                f"agents.workspace_root {root} is writable by others, not sticky and not the job's "
                f"(uid {st.st_uid}): sandboxed executions could replace the run's folders; give the job a "
                "folder of its own"
            )
        os.fchmod(fd, 0o711)


def protect_job_folders(workspaces: Path, private: tuple[str, ...] = ("records",)) -> None:
    """In the job's run folder (`workspaces`' parent): executions may traverse to their workspaces but
    list nothing, and read none of the job's files; `private` folders are created 0700 if missing."""
    run_dir = workspaces.parent
    workspaces.mkdir(parents=True, exist_ok=True)
    for name in private:
        (run_dir / name).mkdir(mode=0o700, exist_ok=True)
    for entry in run_dir.iterdir():
        if entry != workspaces and not entry.is_symlink():
            os.chmod(entry, entry.stat().st_mode & 0o7700)
    os.chmod(workspaces, 0o711)
    os.chmod(run_dir, 0o711)
