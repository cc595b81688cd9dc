"""Call records: one per model call of an execution, exactly the tokens the policy saw and produced.

The proxy writes one `CallRecord` per model call; the trajectory processor merges an execution's
records into a prefix tree (`gyre_ray.trajectory.tree`). On disk a record is one JSON object per
line (JSONL) with these fields:

| field | type | meaning |
|---|---|---|
| `execution_id` | str | the execution (one agent run) the call belongs to |
| `call_id` | str | unique within the execution |
| `role` | str | `main`, `main-summary`, `sub-agent`, `sub-agent-summary` or `unknown` |
| `input_ids` | list[int] | the full prompt, token ids (non-empty) |
| `output_ids` | list[int] | the tokens the policy generated (may be empty after an abort) |
| `output_logprobs` | list[float] | behaviour log-probability of each output token (<= 0) |
| `versions` | list[int] | policy version that generated each output token (>= 0) |
| `t_start`, `t_end` | float | wall-clock seconds; `t_end >= t_start` |
| `parent_call_id` | str or null | optional: the call whose context this one continues, if known |
| `session` | str or null | optional: harness session id (e.g. Claude Code's `metadata.user_id`) |
| `meta` | object | optional: anything else (model name, finish reason, ...) |

The record store writes its files in a chunked form of this format (`record_chunks`): a prompt's
leading whole chunks of 2,048 ids go to chunk lines written once per file, and the record line
names them in `input_chunks`; `read_jsonl` reads both forms and returns whole records, and every
record the store or the proxy hands out (`/gyre/executions/{id}/records`) is in the plain form.

Records that contradict themselves are rejected with a `RecordError` naming the field and limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from gyre_ray.json_values import is_int
from gyre_ray.trajectory.record_chunks import ChunkError, ChunkReader, chunked_lines

ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary", "unknown")
REQUIRED_FIELDS = (
    "execution_id",
    "call_id",
    "role",
    "input_ids",
    "output_ids",
    "output_logprobs",
    "versions",
    "t_start",
    "t_end",
)
OPTIONAL_FIELDS = ("parent_call_id", "session", "meta")
# Engines report log-probabilities computed in float; allow this much rounding above 0.
LOGPROB_TOLERANCE = 1e-4


class RecordError(ValueError):
    """A call record that cannot be trusted; the message names the record and the offending field."""


_INT_TYPES = frozenset((int,))
_NUMBER_TYPES = frozenset((int, float))


MAX_TOKEN_ID = 2**32 - 1  # token ids are kept as 32-bit unsigned (role matching, record chunks)


def _ids_in_range(ids: list[Any], limit: int | None) -> bool:
    """True when every item is an `int` (exactly: no bool) in [0, limit): one pass in C for the types,
    one each for min and max. False means "look item by item" (it may still be valid, e.g. an int
    subclass), never that the list is bad."""
    if not ids:
        return True
    if not set(map(type, ids)) <= _INT_TYPES or min(ids) < 0:
        return False
    return limit is None or max(ids) < limit


def _logprobs_ok(values: list[Any]) -> bool:
    """True when every item is an int or float, all finite (their sum is) and none above the
    tolerance, checked in C; False means "look item by item"."""
    if not values:
        return True
    if not set(map(type, values)) <= _NUMBER_TYPES:
        return False
    try:
        return math.isfinite(sum(values)) and max(values) <= LOGPROB_TOLERANCE
    except OverflowError:  # an int too large for a float: the item-by-item check says what it is
        return False


def _json_default(value: Any) -> Any:
    """What `asdict` made of a dataclass nested in `meta` (the JSON is the same as it always was)."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


@dataclass
class CallRecord:
    """One model call: the exact prompt tokens, generated tokens, their logprobs and policy versions."""

    execution_id: str
    call_id: str
    role: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    versions: list[int]
    t_start: float
    t_end: float
    parent_call_id: str | None = None
    session: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.input_ids) + len(self.output_ids)

    def validate(self, vocab_size: int | None = None) -> CallRecord:
        """Raise RecordError if the record contradicts itself; return self so calls can be chained.

        Checks: string ids, a known role, integer token ids in [0, vocab_size), one logprob (finite,
        <= 0) and one version (integer >= 0) per output token, and t_end >= t_start.
        """
        where = f"record {self.execution_id!r}/{self.call_id!r}"
        for name in ("execution_id", "call_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise RecordError(f"{where}: {name} must be a non-empty string, got {value!r}")
        if self.role not in ROLES:
            raise RecordError(f"{where}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
            raise RecordError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if not isinstance(self.input_ids, list) or not self.input_ids:
            raise RecordError(f"{where}: input_ids must be a non-empty list of token ids")
        for name in ("input_ids", "output_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list):
                raise RecordError(f"{where}: {name} must be a list, got {type(ids).__name__}")
            if _ids_in_range(ids, vocab_size or MAX_TOKEN_ID + 1):
                continue  # all valid; else find the first bad item below
            for i, tok in enumerate(ids):
                if not is_int(tok) or tok < 0:
                    raise RecordError(f"{where}: {name}[{i}] = {tok!r} is not a token id (integer >= 0)")
                if vocab_size is not None and tok >= vocab_size:
                    raise RecordError(
                        f"{where}: {name}[{i}] = {tok} is outside the vocabulary (vocab_size {vocab_size})"
                    )
                if tok > MAX_TOKEN_ID:
                    raise RecordError(
                        f"{where}: {name}[{i}] = {tok} is beyond any vocabulary (over 2**32 - 1)"
                    )
        n_out = len(self.output_ids)
        for name in ("output_logprobs", "versions"):
            values = getattr(self, name)
            if not isinstance(values, list):
                raise RecordError(f"{where}: {name} must be a list, got {type(values).__name__}")
            if len(values) != n_out:
                raise RecordError(f"{where}: {name} has {len(values)} entries but output_ids has {n_out}")
        # The fast checks pass (C loops) for any valid list; only then are items looked at one by one.
        if not _logprobs_ok(self.output_logprobs):
            for i, lp in enumerate(self.output_logprobs):
                if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not _finite(lp):
                    raise RecordError(f"{where}: output_logprobs[{i}] = {lp!r} is not a finite number")
                if lp > LOGPROB_TOLERANCE:
                    raise RecordError(f"{where}: output_logprobs[{i}] = {lp} is a log-probability above 0")
        if not _ids_in_range(self.versions, None):
            for i, version in enumerate(self.versions):
                if not is_int(version) or version < 0:
                    raise RecordError(f"{where}: versions[{i}] = {version!r} must be an integer >= 0")
        for name in ("t_start", "t_end"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not _finite(value):
                raise RecordError(f"{where}: {name} = {value!r} is not a finite number of seconds")
        if self.t_end < self.t_start:
            raise RecordError(f"{where}: t_end {self.t_end} is before t_start {self.t_start}")
        for name in ("parent_call_id", "session"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RecordError(f"{where}: {name} must be a string or null, got {value!r}")
        if not isinstance(self.meta, dict):
            raise RecordError(f"{where}: meta must be an object, got {type(self.meta).__name__}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dictionary with the on-disk field names (its lists and `meta` are copies, shallow:
        `dataclasses.asdict`'s deep copy took ~90 ms for a 150k-token record)."""
        return {k: v.copy() if isinstance(v, (list, dict)) else v for k, v in self._fields().items()}

    def to_json(self) -> str:
        """One JSONL line (no trailing newline)."""
        return json.dumps(self._fields(), separators=(",", ":"), default=_json_default)

    def to_file_lines(self, written_chunks: set[str]) -> list[str]:
        """The lines that append this record to a records file in the chunked form
        (`gyre_ray.trajectory.record_chunks`): chunk lines the file lacks (`written_chunks`, updated),
        then the record."""
        return chunked_lines(self._fields(), written_chunks, _json_default)

    def _fields(self) -> dict[str, Any]:
        """The fields by on-disk name, in order; the values are the record's own (not copies)."""
        return {
            "execution_id": self.execution_id,
            "call_id": self.call_id,
            "role": self.role,
            "input_ids": self.input_ids,
            "output_ids": self.output_ids,
            "output_logprobs": self.output_logprobs,
            "versions": self.versions,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "parent_call_id": self.parent_call_id,
            "session": self.session,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any, vocab_size: int | None = None) -> CallRecord:
        """Build and validate a record from a decoded JSON object."""
        if not isinstance(data, dict):
            raise RecordError(f"a call record must be a JSON object, got {type(data).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in data]
        if missing:
            raise RecordError(f"call record is missing field(s): {', '.join(missing)}")
        unknown = sorted(set(data) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise RecordError(
                f"call record has unknown field(s) {', '.join(unknown)}; put extra data under 'meta'"
            )
        kwargs = {name: data[name] for name in REQUIRED_FIELDS + OPTIONAL_FIELDS if name in data}
        if kwargs.get("meta") is None:
            kwargs["meta"] = {}
        return cls(**kwargs).validate(vocab_size)

    @classmethod
    def from_json(cls, line: str, vocab_size: int | None = None) -> CallRecord:
        """Parse and validate one JSONL line."""
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"call record is not valid JSON: {exc}") from None
        return cls.from_dict(data, vocab_size)


def validate_execution(records: Iterable[CallRecord], vocab_size: int | None = None) -> list[CallRecord]:
    """Validate each record and the set: one execution id, call ids unique. Returns the list."""
    records = list(records)
    seen: set[str] = set()
    execution_ids = {r.execution_id for r in records}
    if len(execution_ids) > 1:
        raise RecordError(f"records of one execution carry several execution ids: {sorted(execution_ids)}")
    for record in records:
        record.validate(vocab_size)
        if record.call_id in seen:
            raise RecordError(f"execution {record.execution_id!r}: duplicate call_id {record.call_id!r}")
        seen.add(record.call_id)
    return records


def read_jsonl(path: str | Path, vocab_size: int | None = None) -> list[CallRecord]:
    """Read and validate every record of a JSONL file, plain or chunked (`record_chunks`: records come
    back whole); errors name the file and line number."""
    records: list[CallRecord] = []
    chunks = ChunkReader()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RecordError(f"{path}:{lineno}: not UTF-8 text (is this a JSONL file?)") from None
            if not line.strip():
                continue
            try:
                data = chunks.take(json.loads(line))
                if data is not None:
                    records.append(CallRecord.from_dict(data, vocab_size))
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path}:{lineno}: call record is not valid JSON: {exc}") from None
            except (RecordError, ChunkError) as exc:
                raise RecordError(f"{path}:{lineno}: {exc}") from None
    return records


def write_jsonl(path: str | Path, records: Iterable[CallRecord]) -> int:
    """Write records one per line (overwriting `path`); returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(record.to_json() + "\n")
            count += 1
    return count


def group_by_execution(records: Iterable[CallRecord]) -> dict[str, list[CallRecord]]:
    """Records keyed by execution id, each list in file order."""
    out: dict[str, list[CallRecord]] = {}
    for record in records:
        out.setdefault(record.execution_id, []).append(record)
    return out


def _finite(value: float) -> bool:
    """`math.isfinite`, False for an int beyond float range (where isfinite raises OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
