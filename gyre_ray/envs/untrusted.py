"""Reading and writing files in folders an execution controls, from the job (root, for a sandbox).

An execution's uid owns its workspace and its evaluator scratch folder, so between two of the job's
steps its code may have put a symbolic link (or a FIFO, or a huge file) where the job expects its
own file. The job therefore never follows a link there: it reads only regular files, at most a
given number of bytes, and writes a file only by creating it afresh (`O_EXCL | O_NOFOLLOW`) after
removing whatever entry had its name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


class UntrustedFileError(OSError):
    """The entry is a link, not a regular file, or cannot be opened; the message says which."""


def read_untrusted(path: Path, limit: int, tail: bool = False) -> bytes:
    """At most `limit` bytes of the regular file `path` (its last ones with `tail`), never through a link.

    FileNotFoundError when there is no such entry; UntrustedFileError for a link or anything but a
    regular file.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            raise UntrustedFileError(f"{path.name} is a symbolic link; not followed") from None
        raise UntrustedFileError(f"{path.name} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFileError(f"{path.name} is not a regular file")
        if tail and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_fresh(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` to a new file at `path`, removing any entry of that name first (a link is removed,
    not followed); fails rather than write through a link planted in between."""
    try:
        if path.is_dir() and not path.is_symlink():
            raise UntrustedFileError(f"{path.name} is a folder")
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        raise UntrustedFileError(f"{path.name} is a folder") from None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def remove_entries(*paths: Path) -> None:
    """Remove whatever is at `paths` (a file, a link, a FIFO, a folder tree; nothing is fine), never
    following a link (a link is removed itself), at any depth and path length (`remove_tree`: by
    descriptor, without the recursion of `shutil.rmtree`, which a tree 1,000 folders deep breaks)."""
    from gyre_ray.agents.scratch import remove_tree

    for path in paths:
        remove_tree(path)
