"""Shared prompt prefixes written once per records file: the chunked form of the call-record JSONL.

Harnesses re-send their whole conversation on every call, so an execution's prompts repeat each
other: written whole, a synthetic 417-call execution of 150k-token contexts took 192 MiB for 564k
distinct tokens (docs/trajectory.md). In the chunked form the record store writes, a prompt's
leading whole chunks of `CHUNK_TOKENS` ids go to *chunk lines* the first time the file needs them,

    {"chunk": "<24 hex digits>", "ids": [...]}

and a record line names them in `input_chunks` (in order), its `input_ids` holding only what
follows them. Prompts that share a prefix share its chunks, which are then written once per file.
A chunk line always comes before the first record that names it (in the same append), so a torn
last line never leaves a record without its chunks. `read_jsonl` puts records back whole; nothing
outside the file format sees chunks. A file without chunk lines is the plain format, read as before.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable
from typing import Any

CHUNK_TOKENS = 2048
CHUNK_LINE_PREFIX = b'{"chunk":'  # how a reader tells a chunk line from a record without parsing it


def chunk_digest(ids: list[int]) -> str:
    """The name of a chunk: 12 bytes of BLAKE2b over its ids (as 8-byte integers), in hex."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=12).hexdigest()


def chunked_lines(
    record_fields: dict[str, Any], written: set[str], default: Callable[[Any], Any] | None = None
) -> list[str]:
    """The lines that write one record: chunk lines for the chunks `written` (the file's) lacks, then
    the record line. `record_fields`: the record's on-disk fields (`CallRecord._fields()`); `written`
    is updated; `default` is json.dumps' hook for values of `meta`."""
    ids = record_fields["input_ids"]
    whole = len(ids) // CHUNK_TOKENS
    if whole == 0:
        return [json.dumps(record_fields, separators=(",", ":"), default=default) + "\n"]
    lines, names = [], []
    for k in range(whole):
        piece = ids[k * CHUNK_TOKENS : (k + 1) * CHUNK_TOKENS]
        name = chunk_digest(piece)
        if name not in written:
            lines.append(json.dumps({"chunk": name, "ids": piece}, separators=(",", ":")) + "\n")
            written.add(name)
        names.append(name)
    fields = {"input_chunks": names, **record_fields, "input_ids": ids[whole * CHUNK_TOKENS :]}
    lines.append(json.dumps(fields, separators=(",", ":"), default=default) + "\n")
    return lines


class ChunkError(ValueError):
    """A chunk line or a record's `input_chunks` that does not hold together."""


class ChunkReader:
    """Puts chunked records of one file back whole, line by line (chunk lines first)."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[int]] = {}

    def take(self, data: Any) -> dict[str, Any] | None:
        """A chunk line is kept (None returned); a record's fields come back with whole `input_ids`."""
        if isinstance(data, dict) and "chunk" in data:
            name, ids = data.get("chunk"), data.get("ids")
            if not isinstance(name, str) or not isinstance(ids, list) or len(ids) != CHUNK_TOKENS:
                raise ChunkError(f"a chunk line needs a name and {CHUNK_TOKENS} ids")
            self.chunks[name] = ids
            return None
        if not isinstance(data, dict) or "input_chunks" not in data:
            return data
        names = data.pop("input_chunks")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ChunkError("input_chunks must be a list of chunk names")
        missing = [n for n in names if n not in self.chunks]
        if missing:
            raise ChunkError(f"input_chunks names chunk {missing[0]} that no earlier line of the file holds")
        tail = data.get("input_ids")
        if not isinstance(tail, list):
            raise ChunkError("input_ids must be a list")
        data["input_ids"] = [t for n in names for t in self.chunks[n]] + tail
        return data
