"""Exec wrapper that puts rlimits on a harness, then becomes it: `python -I -S .../gyre_ray/agents/limits.py
[--uid U --gid G --scratch-mb S --memory-mb R [--own DIR ...] [--report-fd N]] --cwd DIR --nproc N
--fsize-mb M -- COMMAND...`
(run as a script, standard library only: no site-packages, no .pth file, is processed while it is root).

With `--uid` (an execution with a uid of its own; the wrapper starts as root) it first gives the
command a mount and IPC namespace of its own (`private_mounts`): a fresh procfs mounted
`hidepid=invisible`, so the processes of other uids (other executions', whose command lines hold
their prompts and their tools' commands, and the job's) are not there to read; its own SysV IPC,
bounded by its memory limit; and one private tmpfs of `--scratch-mb` MiB serving /tmp, /var/tmp,
/dev/shm, /run/lock and the like (what the command needs inside one, e.g. a run folder under /tmp,
bound back in: read-only but for its own folders, `--own`, cwd, HOME and TMPDIR), so what it writes
there is its own, bounded in all, and gone with its last process.
Then it drops to the uid and gid (no supplementary groups), and only then enters DIR (the workspace,
which an evaluator's run finds as the agent left it: root never works in it). It runs isolated
(`-I -S`: neither the environment's PYTHON* variables, the working folder nor site-packages reach
its imports). A host
that refuses the namespace or a mount (no CAP_SYS_ADMIN) gets one warning line in the execution's
log and the shared folders (whose leftovers `sandbox.reclaim` removes: `gyre_ray.agents.scratch`);
the job learns it beforehand (`--probe`, once per process) and watches those folders instead. With
`--report-fd N` (a socket) it writes "ok" on N once every mount is in place (the job then need not
sweep the folders its tmpfs served), or "shared" where one failed and then waits for the job's go
(the job first measures what the uid holds in the folders now shared, so that all it writes there
counts), and closes N before the command starts.

Then, as the uid, `RLIMIT_NPROC` (which counts processes per uid) bounds a fork bomb to N processes;
`RLIMIT_FSIZE` ends a write past M MiB (one file, the log included); no core dumps; files it creates
are private (umask 077). Memory, total disk and wall time are watched from outside
(`gyre_ray.agents.supervise`), as rlimits cannot bound them for a tree.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import stat
import sys
from collections.abc import Mapping

_CLONE_NEWNS, _CLONE_NEWIPC = 0x00020000, 0x08000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 0x1, 0x20, 0x2
_PR_SET_NO_NEW_PRIVS = 38
# the shared folders any user may write, each backed by the execution's private tmpfs (where present,
# not links, and not itself a path it needs; what it needs inside one is bound back in)
PRIVATE_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/var/crash", "/run/shm")
DEFAULT_SCRATCH_MB = 1024  # the private tmpfs's size when no disk limit is set


def private_mounts(scratch_mb: int, memory_mb: int, needed: list[str], own: list[str] = ()) -> str:
    """Give this process (and what it starts) a mount and an IPC namespace of its own: /proc mounted
    hidepid=invisible (other uids' processes are not there); SysV shared memory bounded by `memory_mb`;
    and one tmpfs of `scratch_mb` MiB (nosuid, nodev, inodes bounded) at the first PRIVATE_SCRATCH
    folder, with a folder of it bound over each other one, so what it writes there is its alone,
    bounded in all, and gone with its last process. What it needs in such a folder (its run folder
    under /tmp: the `needed` paths) is bound back in: each top entry holding one read-only, and its
    `own` folders (workspace, HOME, TMPDIR) over that writable, so nothing else of the shared folder
    is there to read or write. A folder that is itself a needed path stays shared.
    '' when done, else what failed (from there on the shared ones are kept)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size_mb = scratch_mb if scratch_mb > 0 else DEFAULT_SCRATCH_MB
    plain = _MS_NOSUID | _MS_NODEV
    folders = private_scratch(needed)
    through = {folder: tops for folder in folders if (tops := _tops_under(folder, needed))}
    shared_fds: dict[str, int] = {}  # each such folder as it was, to bind from once it is covered
    steps = [
        ("unshare(CLONE_NEWNS | CLONE_NEWIPC)", lambda: libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC)),
        ("bounding SysV IPC", lambda: _bound_ipc(memory_mb)),
        ("making mounts private", lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)),
        ("mounting /proc hidepid=invisible",
         lambda: libc.mount(b"proc", b"/proc", b"proc", plain | _MS_NOEXEC, b"hidepid=invisible")),
        ("opening the scratch folders", lambda: _open_folders(list(through), shared_fds)),
    ]  # fmt: skip
    if folders:
        base, options = folders[0], f"mode=1777,size={size_mb}m,nr_inodes={max(1024, size_mb * 256)}"
        steps.append((f"mounting a tmpfs at {base}", lambda: libc.mount(b"tmpfs", base.encode(), b"tmpfs", plain, options.encode())))  # fmt: skip
        for folder in folders[1:]:
            steps.append((f"binding {folder}", lambda f=folder: _bind_into(libc, base, f)))
    for folder, tops in through.items():
        steps.append((f"binding what it needs back into {folder}",
                      lambda f=folder, t=tops: _bind_through(libc, f, shared_fds[f], t, own)))  # fmt: skip
    for step, call in steps:
        if call() != 0:
            return f"{step}: {os.strerror(ctypes.get_errno())}"
    return ""


def _tops_under(folder: str, paths: list[str]) -> list[str]:
    """The names of `folder`'s entries that hold (or are) one of `paths`."""
    tops = set()
    for path in paths:
        path = os.path.normpath(path)
        if path.startswith(folder + "/"):
            tops.add(path[len(folder) + 1 :].split("/")[0])
    return sorted(tops - {"", ".", ".."})


def _open_folders(folders: list[str], fds: dict[str, int]) -> int:
    """Each of `folders` opened (close-on-exec) into `fds`; -1 with errno set when one does not open."""
    try:
        for folder in folders:
            fds[folder] = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        ctypes.set_errno(exc.errno or 1)
        return -1
    return 0


def _bind_through(libc: ctypes.CDLL, folder: str, fd: int, tops: list[str], own: list[str]) -> int:
    """Into `folder`, now private, bind each of `tops` from the shared one (`fd`) read-only (a link is
    made again as a link), then each `own` path under it writable. On failure the private folder is
    taken away again (the shared one is seen), and -1 returned with errno set."""
    try:
        _bind_each(libc, folder, f"/proc/self/fd/{fd}", tops, own)
        return 0
    except OSError as exc:
        libc.umount2(folder.encode(), _MNT_DETACH)
        ctypes.set_errno(exc.errno or 1)
        return -1


def _bind_each(libc: ctypes.CDLL, folder: str, shared: str, tops: list[str], own: list[str]) -> None:
    def mount(source: str | None, target: str, flags: int) -> None:
        if libc.mount(None if source is None else source.encode(), target.encode(), None, flags, None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), target)

    for top in tops:
        source, target = f"{shared}/{top}", f"{folder}/{top}"
        try:
            mode = os.lstat(source).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(source), target)
            continue
        if stat.S_ISDIR(mode):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        mount(source, target, _MS_BIND)
        mount(None, target, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    for path in sorted({os.path.normpath(path) for path in own}, key=len):  # a parent before its child
        source = f"{shared}/{path[len(folder) + 1 :]}"
        if path.startswith(folder + "/") and _is_folder(source):
            mount(source, path, _MS_BIND)


def _is_folder(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _bound_ipc(memory_mb: int) -> int:
    """This IPC namespace's SysV limits (a new one starts at the kernel's, practically unbounded): shared
    memory at most `memory_mb` in all (0: left as is), few segments and queues."""
    if memory_mb <= 0:
        return 0
    settings = {"shmmax": memory_mb << 20, "shmall": (memory_mb << 20) // os.sysconf("SC_PAGE_SIZE"),
                "shmmni": 64, "msgmni": 16}  # fmt: skip
    for name, value in settings.items():
        with open(f"/proc/sys/kernel/{name}", "w") as f:
            f.write(str(value))
    return 0


def _bind_into(libc: ctypes.CDLL, base: str, folder: str) -> int:
    """Bind a fresh world-writable folder of the private tmpfs at `base` over `folder`."""
    inside = f"{base}/.gyre{folder.replace('/', '-')}"
    os.mkdir(inside)
    os.chmod(inside, 0o1777)
    return libc.mount(inside.encode(), folder.encode(), None, _MS_BIND, None)


def present_folders(folders: tuple[str, ...]) -> list[str]:
    """Those of `folders` that are folders here, not links."""
    return [folder for folder in folders if os.path.isdir(folder) and not os.path.islink(folder)]


def private_scratch(needed: list[str]) -> list[str]:
    """The PRIVATE_SCRATCH folders present here (not links) that are none of the `needed` paths (what
    it needs inside one is bound back in: `private_mounts`)."""
    needed = [os.path.normpath(path) for path in needed]
    return [folder for folder in present_folders(PRIVATE_SCRATCH) if folder not in needed]


def needed_paths(
    command: list[str], cwd: str | None, env: Mapping[str, str] | None = None, folders: list[str] = ()
) -> list[str]:
    """Absolute paths the command will reach: its arguments' as given (they may name the agent's files:
    never resolved here, as root), and, resolved too in case a link leads into a scratch folder, its
    own folders (`own_paths`), the folders of its PATH (from `env`, by default this process's) and this
    interpreter (all the job's). `supervise` asks the same to know which scratch folders go private."""
    env = os.environ if env is None else env
    jobs = _with_resolved([sys.executable, *env.get("PATH", "").split(":")])
    return [v for v in command if v.startswith("/")] + own_paths(folders, cwd, env) + jobs


def own_paths(folders: list[str], cwd: str | None, env: Mapping[str, str] | None = None) -> list[str]:
    """The folders the command writes: `folders` (its workspace, HOME, TMPDIR, evaluator folder, as the
    job names them), `cwd`, HOME and TMPDIR (from `env`, by default this process's), each as given and
    resolved."""
    env = os.environ if env is None else env
    return _with_resolved([*folders, cwd or "", env.get("HOME", ""), env.get("TMPDIR", "")])


def _with_resolved(paths: list[str]) -> list[str]:
    """The absolute ones of `paths`, then each of them resolved."""
    absolute = [path for path in paths if path.startswith("/")]
    return absolute + [os.path.realpath(path) for path in absolute]


def become(uid: int, gid: int) -> None:
    """Drop from root to `uid`/`gid` for good, with no supplementary groups, and no way back up through
    a setuid program (no_new_privs)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def apply_limits(nproc: int, fsize_mb: int) -> None:
    """Lower this process's limits (children inherit them)."""
    if nproc > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if fsize_mb > 0:
        size = fsize_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o077)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gyre_ray.agents.limits")
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--gid", type=int, default=None)
    parser.add_argument("--cwd", default=None, help="enter this folder (after dropping to --uid)")
    parser.add_argument("--scratch-mb", type=int, default=0, help="size of its private /tmp (0: 1024)")
    parser.add_argument("--memory-mb", type=int, default=0, help="bound on its SysV shared memory (0: none)")
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--fsize-mb", type=int, default=0)
    parser.add_argument("--own", action="append", default=[], help="a folder of its own, kept writable")
    parser.add_argument("--report-fd", type=int, default=-1, help="say 'ok' or 'shared' here (a socket)")
    parser.add_argument("--probe", action="store_true", help="only try the private mounts; say what failed")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.probe:  # in this process's own namespace, gone with it
        why = private_mounts(1, 0, [])
        print(why or "ok")
        sys.exit(1 if why else 0)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if (args.uid is None) != (args.gid is None):
        parser.error("--uid and --gid go together")
    if args.uid is not None:
        try:
            needed = needed_paths(command, args.cwd, folders=args.own)
            why = private_mounts(args.scratch_mb, args.memory_mb, needed, own_paths(args.own, args.cwd))
            if why:
                print(f"gyre-ray: warning: private /proc, /tmp and IPC incomplete ({why}); the shared ones "
                      "are used from there on", file=sys.stderr, flush=True)  # fmt: skip
                if args.report_fd >= 0:  # the job measures them before the command can write there
                    os.write(args.report_fd, b"shared\n")
                    os.read(args.report_fd, 1)  # its go (or its end)
            elif args.report_fd >= 0:  # the job then need not sweep the folders its tmpfs served
                os.write(args.report_fd, b"ok\n")
            become(args.uid, args.gid)
        except Exception as exc:  # as root: one line, never a traceback, and the command never starts
            print(f"gyre-ray: cannot start {command[0]!r}: sandbox setup failed ({exc!r})", file=sys.stderr)
            sys.exit(127)
        finally:
            if args.report_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(args.report_fd)  # never handed to the command
    apply_limits(args.nproc, args.fsize_mb)
    try:
        if args.cwd is not None:
            os.chdir(args.cwd)
        os.execvp(command[0], command)
    except OSError as exc:  # (a folder it may not enter reads the same: the command cannot start there)
        print(f"gyre-ray: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
