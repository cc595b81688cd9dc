"""Exec wrapper that puts rlimits on a harness, then becomes it: `python -I -m gyre_ray.agents.limits
[--uid U --gid G --scratch-mb S] --cwd DIR --nproc N --fsize-mb M -- COMMAND...`.

With `--uid` (an execution with a uid of its own; the wrapper starts as root) it first gives the
command a mount and IPC namespace of its own (`private_mounts`): a fresh procfs mounted
`hidepid=invisible`, so the processes of other uids (other executions', whose command lines hold
their prompts and their tools' commands, and the job's) are not there to read; its own SysV IPC; and
a private tmpfs of `--scratch-mb` MiB over /tmp, /var/tmp, /dev/shm, /run/lock and the like, each
that holds nothing the command needs (a run folder under /tmp keeps the shared /tmp), so what it
writes there is its own, bounded, and gone with its last process.
Then it drops to the uid and gid (no supplementary groups), and only then enters DIR (the workspace,
which an evaluator's run finds as the agent left it: root never works in it). It runs isolated
(`-I`: neither the environment's PYTHON* variables nor the working folder reach its imports). A host
that refuses the namespace or a mount (no CAP_SYS_ADMIN) gets one warning line in the execution's
log and the shared folders (whose leftovers `sandbox.reclaim` removes: `gyre_ray.agents.scratch`).

Then, as the uid, `RLIMIT_NPROC` (which counts processes per uid) bounds a fork bomb to N processes;
`RLIMIT_FSIZE` ends a write past M MiB (one file, the log included); no core dumps; files it creates
are private (umask 077). Memory, total disk and wall time are watched from outside
(`gyre_ray.agents.supervise`), as rlimits cannot bound them for a tree.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys

_CLONE_NEWNS, _CLONE_NEWIPC = 0x00020000, 0x08000000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
# the shared folders any user may write, each backed by a tmpfs of the execution's own (where present,
# not links, and holding nothing it needs)
PRIVATE_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/var/crash", "/run/shm")


def private_mounts(scratch_mb: int, needed: list[str]) -> str:
    """Give this process (and what it starts) a mount and an IPC namespace of its own: /proc mounted
    hidepid=invisible (other uids' processes are not there), its own SysV IPC, and a tmpfs of
    `scratch_mb` MiB (0: the kernel's default, half the memory) over each PRIVATE_SCRATCH folder that
    holds none of the `needed` paths (its workspace, HOME, TMPDIR, the command's files: a run folder
    under /tmp keeps the shared /tmp), so what it writes there is its alone, bounded, and gone with
    its last process. '' when done, else why not (the caller goes on with the shared ones)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = f",size={scratch_mb}m" if scratch_mb > 0 else ""
    steps = [
        ("unshare(CLONE_NEWNS | CLONE_NEWIPC)", lambda: libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC)),
        ("making mounts private", lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)),
        ("mounting /proc hidepid=invisible", lambda: libc.mount(b"proc", b"/proc", b"proc", 0, b"hidepid=invisible")),
    ]  # fmt: skip
    for folder in private_scratch(needed):
        options = f"mode=1777{size}".encode()
        steps.append((f"mounting a tmpfs at {folder}", lambda f=folder, o=options: libc.mount(b"tmpfs", f.encode(), b"tmpfs", 0, o)))  # fmt: skip
    for step, call in steps:
        if call() != 0:
            return f"{step}: {os.strerror(ctypes.get_errno())}"
    return ""


def private_scratch(needed: list[str]) -> list[str]:
    """The PRIVATE_SCRATCH folders present here (not links) that hold none of the `needed` paths."""
    return [
        folder
        for folder in PRIVATE_SCRATCH
        if os.path.isdir(folder)
        and not os.path.islink(folder)
        and not any(path == folder or path.startswith(folder + "/") for path in needed)
    ]


def needed_paths(command: list[str], cwd: str | None) -> list[str]:
    """Absolute paths the command will reach: `cwd`, its arguments', its HOME and TMPDIR, the folders
    of its PATH and this interpreter (resolved too, in case a link leads into a scratch folder)."""
    values = [cwd or "", *command, os.environ.get("HOME", ""), os.environ.get("TMPDIR", ""), sys.executable]
    values += os.environ.get("PATH", "").split(":")
    absolute = [v for v in values if v.startswith("/")]
    return absolute + [os.path.realpath(v) for v in absolute]


def become(uid: int, gid: int) -> None:
    """Drop from root to `uid`/`gid` for good, with no supplementary groups."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


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
    parser.add_argument("--scratch-mb", type=int, default=0, help="size of its private /tmp (0: default)")
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--fsize-mb", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if (args.uid is None) != (args.gid is None):
        parser.error("--uid and --gid go together")
    if args.uid is not None:
        why = private_mounts(args.scratch_mb, needed_paths(command, args.cwd))
        if why:
            warning = f"gyre-ray: warning: no private /proc and /tmp for this execution ({why})"
            print(warning, file=sys.stderr, flush=True)
        become(args.uid, args.gid)
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
