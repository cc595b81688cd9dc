"""The store's files in durable mode: what lets a restarted store actor come back with every record.

    registry = Registry(records_dir, fsync=True)  # <records_dir>/.registry.jsonl
    registry.registered(execution_id, api_key, metadata)   # an execution and the sha-256 of its key
    registry.finished(execution_id, records)               # with how many records its file holds
    for event in registry.replay(): ...                    # a restarted store reads them back
    append_records(path, records, True, chunks)            # a group commit: one write + fsync per file
    count, outputs = scan_records(path, chunks)            # a torn last line is cut off
    count = count_records(path)                            # the same count, nothing parsed

Every call record is appended to its execution's `<execution_id>.jsonl` (the call-record JSONL of
`gyre_ray.trajectory.records`, in its chunked form: a shared prompt prefix is written once per file,
`gyre_ray.trajectory.record_chunks`; `chunks` names the chunks a file holds) when the store applies it, and fsync'd before the batch is
acknowledged. The registry keeps no API key, only its sha-256: a restarted store checks a
presented key against it. Execution ids never start with ".", so `.registry.jsonl` names no
execution, and `.splice/<execution_id>.jsonl` holds each execution's splice keys (key -> call id),
so a re-sent assistant turn is still rendered token-exact after a restart. A finished execution's
file is not read back: its `finish` line says how many records it holds, and nothing is added to it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gyre_ray.trajectory.record_chunks import CHUNK_LINE_PREFIX
from gyre_ray.trajectory.records import CallRecord

REGISTRY_NAME = ".registry.jsonl"
SPLICE_DIR = ".splice"


def json_object(path: Path, default: Any = None) -> Any:
    """The JSON object a file holds; `default` when it is absent, unreadable, empty or cut off (its
    writer was killed mid-write), or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default
    return data if isinstance(data, dict) else default


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of an append-only file, one per line, up to a torn last line (its writer was
    killed mid-write; nothing after it was ever written); nothing when the file does not exist."""
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            return


def _append_lines(path: Path, lines: list[str], fsync: bool) -> None:
    """Append whole lines or nothing: a short write (a full disk) is carried on, and a failed one is
    cut back to where the file ended, so the file never holds a torn line followed by later ones
    (which would make every later read of it fail) while the error goes to the caller."""
    data = "".join(lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


class Registry:
    """Append-only lines: executions registered (key digest, metadata), re-keyed, closed (key revoked),
    finished (with their record count)."""

    def __init__(self, records_dir: Path, fsync: bool = True) -> None:
        self.path = records_dir / REGISTRY_NAME
        self.fsync = fsync
        records_dir.mkdir(parents=True, exist_ok=True)

    def reset(self) -> None:
        """A new store on this folder: an empty registry and no splice keys of earlier stores."""
        import shutil

        self.path.write_text("", encoding="utf-8")
        shutil.rmtree(self.path.parent / SPLICE_DIR, ignore_errors=True)

    def registered(self, execution_id: str, api_key: str, metadata: dict[str, Any]) -> None:
        self._write({"register": execution_id, "key_sha256": key_digest(api_key), "metadata": metadata})

    def rekeyed(self, execution_id: str, api_key: str) -> None:
        self._write({"rekey": execution_id, "key_sha256": key_digest(api_key)})

    def closed(self, execution_id: str) -> None:
        self._write({"close": execution_id})

    def finished(self, execution_id: str, records: int) -> None:
        self._write({"finish": execution_id, "records": records})

    def replay(self) -> Iterator[dict[str, Any]]:
        """The registry's events in order (a torn last line, the writer killed mid-write, is skipped)."""
        return json_lines(self.path)

    def _write(self, event: dict[str, Any]) -> None:
        _append_lines(self.path, [json.dumps(event) + "\n"], self.fsync)


def append_records(path: Path, records: list[CallRecord], fsync: bool, chunks: set[str]) -> None:
    """Append `records` to `path` in one write (fsync'd when asked), in the chunked form: `chunks` names
    the chunks the file holds (updated; emptied first when the file is not there)."""
    if not path.exists():
        chunks.clear()
    written = set(chunks)  # the file's chunks only once the write went through
    _append_lines(path, [line for record in records for line in record.to_file_lines(written)], fsync)
    chunks |= written


def append_splice(records_dir: Path, execution_id: str, keys: list[tuple[str, str]], fsync: bool) -> None:
    """Remember (splice key, call id) pairs of an execution."""
    folder = records_dir / SPLICE_DIR
    folder.mkdir(exist_ok=True)
    lines = [json.dumps({"k": key, "c": call_id}) + "\n" for key, call_id in keys]
    _append_lines(folder / f"{execution_id}.jsonl", lines, fsync)


def read_splice(records_dir: Path, execution_id: str) -> list[tuple[str, str]]:
    return [(item["k"], item["c"]) for item in json_lines(records_dir / SPLICE_DIR / f"{execution_id}.jsonl")]


def scan_records(path: Path, chunks: set[str] | None = None) -> tuple[int, dict[str, list[int]]]:
    """How many complete records `path` holds and each one's output ids by call id (the names of its
    chunk lines go to `chunks`); a torn last line (the store killed mid-write: it was never
    acknowledged) is cut off the file. Read line by line: one record in memory at a time, besides the
    output ids kept."""
    if not path.exists():
        return 0, {}
    outputs: dict[str, list[int]] = {}
    count = end = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break  # the torn last line
            end += len(line)
            if line.startswith(CHUNK_LINE_PREFIX):
                if chunks is not None:
                    chunks.add(json.loads(line)["chunk"])
            elif line.strip():
                item = json.loads(line)
                outputs[item["call_id"]] = list(item.get("output_ids") or [])
                count += 1
    _cut_torn_tail(path, end)
    return count, outputs


def count_records(path: Path, chunk: int = 1 << 20) -> int:
    """How many complete records `path` holds (as `scan_records` counts them: its complete lines that
    are not blank and not chunk lines), read in blocks and not parsed; a torn last line is cut off the
    file likewise."""
    if not path.exists():
        return 0
    width = len(CHUNK_LINE_PREFIX)
    count = end = offset = 0
    head, nonblank = b"", False  # the line under way (begun in an earlier block): its start, any text
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            *complete, rest = block.split(b"\n")
            for piece in complete:
                start = (head + piece)[:width]
                if (nonblank or piece.strip()) and not start.startswith(CHUNK_LINE_PREFIX):
                    count += 1
                head, nonblank = b"", False
            if complete:
                end = offset + len(block) - len(rest)
            head, nonblank = (head + rest)[:width], nonblank or bool(rest.strip())
            offset += len(block)
    _cut_torn_tail(path, end)
    return count


def _cut_torn_tail(path: Path, end: int) -> None:
    """Cut off what follows the last newline of `path` (`end`: the bytes up to it), if anything does."""
    if path.stat().st_size > end:
        with open(path, "r+b") as fh:
            fh.truncate(end)
