"""Ids of executions started again after their executor died: `r<n>.<planned id>` is the n-th start
after the first. Light on purpose (no torch, no Ray): the toy harness reads them in its sandbox."""

from __future__ import annotations

import re

_STARTED_AGAIN = re.compile(r"r(\d+)\.(.*)")  # `r<n>.<planned id>`: the n-th start after the first


def relaunch_id(execution_id: str) -> str:
    """The id an execution started again gets: `r1.<id>`, then `r2.<id>`, ... A tag before a `.`, as
    run tags are, so what is read from an id's end (its index; the longtail set's durations) stays."""
    match = _STARTED_AGAIN.fullmatch(execution_id)
    return f"r{int(match.group(1)) + 1}.{match.group(2)}" if match else f"r1.{execution_id}"


def planned_id(execution_id: str) -> str:
    """The id a planned execution had before it was started again (`r2.<id>`: `<id>`)."""
    match = _STARTED_AGAIN.fullmatch(execution_id)
    return match.group(2) if match else execution_id


def starts_of(execution_id: str) -> int:
    """How many times a planned execution has been started, read from its id (`r2.<id>`: 3)."""
    match = _STARTED_AGAIN.fullmatch(execution_id)
    return 1 + int(match.group(1)) if match else 1
