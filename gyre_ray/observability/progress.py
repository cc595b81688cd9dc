"""A one-line progress display for long work (rollouts, training), plain enough for logs and CI.

On a terminal it redraws one line; elsewhere it prints a line at most every `min_interval_s`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`with Progress("rollout", total=8) as p: p.update(done=3, note="...")`."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, min_interval_s: float = 5.0
    ) -> None:
        self.label = label
        self.total = max(0, total)
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        self.start = time.monotonic()
        self._last_print = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.start
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        return f"{self.label:10s} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {note}".rstrip()

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        self.done = min(done, self.total) if self.total else done
        now = time.monotonic()
        if self._tty:
            self.stream.write("\r" + self.line(note)[:150].ljust(150))
            self.stream.flush()
        elif force or now - self._last_print >= self.min_interval_s:
            self.stream.write(self.line(note) + "\n")
            self.stream.flush()
            self._last_print = now

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            end = "done"
        else:
            end = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "stopped on an error"
        if self._tty:
            self.stream.write("\r" + self.line(end)[:150].ljust(150) + "\n")
        else:
            self.stream.write(self.line(end) + "\n")
        self.stream.flush()
