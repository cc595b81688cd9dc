"""What an execution's uid leaves outside its own folders: files in the machine's shared scratch
folders (/tmp, /var/tmp, /dev/shm, /run/lock, ...: `scratch_roots`) and SysV IPC objects. Measured
while it runs (`scratch_usage`, `detached_shm_mb`: its disk and memory limits count them) and removed
when it ends (`remove_scratch`, `remove_ipc`), so the next execution that draws the same uid finds
none of it. With the private mounts of `gyre_ray.agents.limits` an execution writes to a tmpfs and
IPC namespace of its own instead, and there is nothing here to find; this covers a scratch folder
that is itself a path the command needs (kept shared) and hosts that refuse the mounts.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gyre_ray.agents.limits import PRIVATE_SCRATCH, present_folders

# the folders any user may write on common systems (where present and not links): the ones the limits
# wrapper backs with the execution's private tmpfs, and POSIX message queues
SCRATCH_FOLDERS = (*PRIVATE_SCRATCH, "/dev/mqueue")
RAM_FS = frozenset(("tmpfs", "ramfs", "hugetlbfs"))  # a file there is memory, not disk
IPC_RMID = 0


def remove_scratch(uid: int, roots: tuple[str, ...] | None = None, gid: int | None = None) -> None:
    """Remove whatever `uid` owns anywhere under the shared scratch folders (`roots`, by default
    `scratch_roots()`), at any depth (a file the execution left in a world-writable folder such as
    /tmp/ray/ would reach the slot's next holder). Links are removed, never followed."""
    for entry, st in _owned_scratch(uid, scratch_roots() if roots is None else roots, gid):
        try:
            if stat.S_ISDIR(st.st_mode):
                remove_tree(entry.path)  # (any depth: by descriptor, no recursion)
            else:
                os.unlink(entry.path)
        except OSError:
            continue


def _owned_scratch(uid: int, roots: tuple[str, ...], gid: int | None, skip: tuple[str, ...] = ()):
    """(entry, lstat) of each entry `uid` owns in a folder under `roots` it may write (what it may have
    left there; an owned folder is one entry, not entered), never in or at the paths `skip`. Only what
    the uid could reach is read: folders it may not traverse are skipped, and only the entries of
    folders it may write are looked at (a full walk of a busy /tmp took 0.6 s per execution)."""
    stack = list(roots)
    while stack:
        folder = stack.pop()
        if folder in skip:
            continue
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or not _may(st, uid, gid, 0o1):
                continue
            entries = list(os.scandir(folder))
        except OSError:
            continue
        writable = _may(st, uid, gid, 0o2)
        for entry in entries:
            try:
                if entry.path in skip:
                    continue
                if writable and (entry_st := entry.stat(follow_symlinks=False)).st_uid == uid:
                    yield entry, entry_st
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
            except OSError:
                continue


# ---- trees an execution's uid wrote: walked by descriptor, at any depth and any path length ---------
# (os.walk skips a folder whose path passes PATH_MAX, and, like shutil.rmtree, recurses: on Python 3.11
# a tree 1000 folders deep raises RecursionError)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
KEEP_OPEN = 32  # folders this deep and deeper hold no descriptor while below them: reopened through ".."
RACES = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # gone, or replaced by a file or a link meanwhile


@dataclass
class _Frame:
    fd: int | None
    dev: int  # of the folder opened (a folder moved meanwhile is not taken for it)
    ino: int
    names: list[str]  # what it holds, not yet given
    name: str  # its name in its parent
    status: os.stat_result | None  # as its parent listed it


def walk_tree(folder: str | Path, failures: list[OSError]) -> Iterator[tuple[int, str, os.stat_result, bool]]:
    """Every entry below `folder`, as (descriptor of its folder, name, lstat, after): each entry once with
    `after` False (a folder before what it holds), and each folder entered once more with `after` True,
    once all it holds was given (the descriptor then its parent's). Never through a link, at any depth and
    any path length (every step relative to a descriptor, without recursion; at most KEEP_OPEN + 2
    descriptors open). `folder` itself is not given, and nothing is when it is missing, not a folder or a
    link. What vanishes or is replaced meanwhile is skipped; any other error is appended to `failures`
    and the walk goes on where it can (a folder moved away while walked below ends it). A descriptor is
    valid only until the next entry is asked for."""
    try:
        fd = os.open(folder, DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in RACES:
            failures.append(exc)
        return
    stack: list[_Frame] = []
    try:
        top = os.fstat(fd)
        stack.append(_Frame(fd, top.st_dev, top.st_ino, [], "", None))
        stack[0].names = os.listdir(fd)
        while stack:
            frame = stack[-1]
            assert frame.fd is not None
            if frame.names:
                name = frame.names.pop()
                try:
                    st = os.stat(name, dir_fd=frame.fd, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in RACES:
                        failures.append(exc)
                    continue
                yield frame.fd, name, st, False
                if stat.S_ISDIR(st.st_mode):
                    child = _enter(frame.fd, name, st, failures)
                    if child is not None:
                        if len(stack) >= KEEP_OPEN:
                            os.close(frame.fd)
                            frame.fd = None
                        stack.append(child)
                continue
            stack.pop()
            if not stack:
                os.close(frame.fd)
                frame.fd = None
                break
            parent = stack[-1]
            if parent.fd is None:
                parent.fd = _parent_of(frame.fd, parent, failures)
            os.close(frame.fd)
            frame.fd = None
            if parent.fd is None:
                return  # (its folder moved: what is above cannot be reached the same way)
            assert frame.status is not None
            yield parent.fd, frame.name, frame.status, True
    except OSError as exc:
        failures.append(exc)
    finally:
        for frame in stack:
            if frame.fd is not None:
                os.close(frame.fd)


def _enter(parent_fd: int, name: str, status: os.stat_result, failures: list[OSError]) -> _Frame | None:
    """The folder `name` in `parent_fd` opened and listed (never through a link), or None."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno not in RACES:
            failures.append(exc)
        return None
    try:
        st = os.fstat(fd)
        return _Frame(fd, st.st_dev, st.st_ino, os.listdir(fd), name, status)
    except OSError as exc:
        os.close(fd)
        failures.append(exc)
        return None


def _parent_of(fd: int, parent: _Frame, failures: list[OSError]) -> int | None:
    """The folder above `fd` opened again, when it is still `parent` (else None, the error in `failures`)."""
    try:
        up = os.open("..", DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        failures.append(exc)
        return None
    st = os.fstat(up)
    if (st.st_dev, st.st_ino) != (parent.dev, parent.ino):
        os.close(up)
        failures.append(OSError(errno.ESTALE, "a folder was moved while its tree was walked", parent.name))
        return None
    return up


def tree_entries(folder: str | Path) -> Iterator[os.stat_result]:
    """The status of every entry below `folder` (links not followed; what vanishes meanwhile is skipped;
    at any depth and path length). OSError where part of the tree could not be read: a measure of it
    would fall short."""
    failures: list[OSError] = []
    for _fd, _name, st, after in walk_tree(folder, failures):
        if failures:
            break
        if not after:
            yield st
    if failures:
        raise failures[0]


def remove_tree(path: str | Path) -> None:
    """Remove the folder `path` and all it holds (a link or a file at `path`: itself), never following a
    link, at any depth and path length; goes on past what it cannot remove, then raises the first error
    (nothing there is fine)."""
    failures: list[OSError] = []
    for fd, name, st, after in walk_tree(path, failures):
        try:
            if after:
                os.rmdir(name, dir_fd=fd)
            elif not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures.append(exc)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        failures.append(exc)
    if failures:
        raise failures[0]


def allocated(status: os.stat_result, seen: set[tuple[int, int]]) -> int:
    """Bytes allocated to an entry; 0 for a further link to a file in `seen` (which it joins)."""
    if status.st_nlink > 1 and not stat.S_ISDIR(status.st_mode):
        if (status.st_dev, status.st_ino) in seen:
            return 0
        seen.add((status.st_dev, status.st_ino))
    return status.st_blocks * 512


def scratch_usage(
    uid: int, gid: int | None, roots: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()
) -> tuple[float, float]:
    """MiB allocated to what `uid` owns in shared scratch (`roots`, by default `scratch_roots()`; a
    folder it owns there counted whole; nothing in or at the folders `skip`, resolved paths, e.g. its
    own workspace under a shared /tmp, counted on its own), and how much of that is memory (tmpfs,
    e.g. /dev/shm)."""
    ram_devs = _scan()[1]
    total = ram = 0
    seen: set[tuple[int, int]] = set()  # a file linked twice counts once
    for entry, st in _owned_scratch(uid, scratch_roots() if roots is None else roots, gid, skip):
        below = tree_entries(entry.path) if stat.S_ISDIR(st.st_mode) else ()
        for one in itertools.chain((st,), below):
            size = allocated(one, seen)
            total += size
            if one.st_dev in ram_devs:
                ram += size
    return total / (1 << 20), ram / (1 << 20)


_scanned: tuple[tuple[str, ...], frozenset[int]] | None = None


def scratch_roots() -> tuple[str, ...]:
    """The folders where an execution's uid may leave files outside its own: those of SCRATCH_FOLDERS that
    are folders here (not links), found once per process."""
    return _scan()[0]


def _scan() -> tuple[tuple[str, ...], frozenset[int]]:
    """`scratch_roots` and the devices of the memory file systems (tmpfs), found on first use."""
    global _scanned
    if _scanned is not None:
        return _scanned
    ram_devs: set[int] = set()
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields, _, rest = line.partition(" - ")
        try:
            if (rest.split() or [""])[0] in RAM_FS:
                major, minor = fields.split()[2].split(":")
                ram_devs.add(os.makedev(int(major), int(minor)))
        except (ValueError, IndexError):
            continue
    _scanned = (tuple(present_folders(SCRATCH_FOLDERS)), frozenset(ram_devs))
    return _scanned


def _sysv_ipc(uid: int, kinds: tuple[str, ...] = ("shm", "sem", "msg")):
    """(kind, id, row) of each SysV IPC object of `kinds` `uid` owns or created ('shm', 'sem' or 'msg';
    row: its line of /proc/sysvipc/<kind> by column)."""
    for kind in kinds:
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        header = lines[0].split() if lines else []
        for line in lines[1:]:
            row = dict(zip(header, line.split(), strict=False))
            try:
                if uid in (int(row["uid"]), int(row["cuid"])):  # an owner may give it away (IPC_SET)
                    yield kind, int(row[header[1]]), row  # shmid, semid or msqid
            except (KeyError, ValueError, IndexError):
                continue


def remove_ipc(uid: int) -> None:
    """Remove every SysV shared-memory segment, semaphore set and message queue of `uid` (they outlive
    its processes: the next holder of the uid would attach to them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, ident, _ in list(_sysv_ipc(uid)):
        if kind == "shm":
            libc.shmctl(ident, IPC_RMID, None)
        elif kind == "sem":
            libc.semctl(ident, 0, IPC_RMID)
        else:
            libc.msgctl(ident, IPC_RMID, None)


def detached_shm_mb(uid: int) -> float:
    """MiB resident in `uid`'s SysV shared-memory segments that no process has attached (memory of no
    process: an attached one is in its resident memory)."""
    rows = (row for _, _, row in _sysv_ipc(uid, ("shm",)) if row.get("nattch") == "0")
    return sum(int(row.get("rss", 0)) for row in rows) / (1 << 20)


def _may(st: os.stat_result, uid: int, gid: int | None, bit: int) -> bool:
    """Whether `uid` (primary group `gid`) has permission `bit` (1 = x, 2 = w) on a file of status `st`."""
    if st.st_uid == uid:
        return bool(st.st_mode & (bit << 6))
    if gid is not None and st.st_gid == gid:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)
