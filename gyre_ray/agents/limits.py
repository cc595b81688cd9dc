"""Exec wrapper that puts rlimits on a harness, then becomes it: `python -m gyre_ray.agents.limits
--nproc N --fsize-mb M -- COMMAND...`.

Run after the switch to the execution's uid (so `RLIMIT_NPROC`, which counts processes per uid,
bounds a fork bomb to N processes); `RLIMIT_FSIZE` ends a write past M MiB (one file, the log
included); no core dumps; files it creates are private (umask 077). Memory, total disk and wall
time are watched from outside (`gyre_ray.agents.supervise`), as rlimits cannot bound them for a tree.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys


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
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--fsize-mb", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    apply_limits(args.nproc, args.fsize_mb)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"gyre-ray: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
