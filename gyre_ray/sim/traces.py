"""Recorded run traces: replay real execution start/end times in the simulator.

A trace is JSONL (one object per line) or CSV (a header row) with one execution per record:
- `start`, `end` (required): seconds (numbers) or ISO-8601 timestamps; duration = end - start.
- `task` (optional): executions of one task form a group (their training work is queued when
  the last one ends). Without it, consecutive records form groups of `group_size`.
- `step` (optional, on every record or none): the RL step the execution belonged to. Simulated
  step s replays recorded step s mod (number of recorded steps); without it, every simulated step
  replays the whole trace.
- `timed_out` (optional): true when the execution hit its timeout (reported only).
- `trajectories` (optional, on every record or none): paths of its tree that were trained (kept after
  the role budget; 0 where its advantage was 0, as a real run leaves those out of training);
  replaces the simulator's K = min(budget, 1 + floor(d / tau)) when given.
- accepted and ignored (what a real run's RUN_DIR/trace.jsonl also writes, docs/scheduling.md):
  `exec_id`, `calls`, `tokens`, `dropped`, `version`, `reward`, `runner`.
Launch times are not replayed: the schedule decides them; only durations are.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from gyre_ray.sim.workload import MAX_DURATION_HOURS, MAX_EXECUTIONS, WorkloadError

_FIELDS = ("start", "end", "task", "step", "timed_out", "trajectories")
_ACCEPTED = ("execution", "id", "exec_id", "calls", "tokens", "dropped", "version", "reward", "runner")


def _time_value(value: Any, field: str, where: str) -> float:
    """Seconds from a finite number, a numeric string or an ISO-8601 time; else WorkloadError."""
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            with contextlib.suppress(ValueError):  # neither a number nor a time: NaN, refused below
                seconds = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    if not math.isfinite(seconds):  # NaN or infinite times would never end in the simulator
        raise WorkloadError(
            f"{where}: field {field!r} must be finite seconds or an ISO-8601 time, got {value!r}"
        )
    return seconds


def _step_value(value: Any, where: str) -> int:
    """The integer of a `step` field (a JSON integer, an integral number or a CSV digit string); else
    WorkloadError naming the record: `1.7` or `true` is no step."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise WorkloadError(f"{where}: field 'step' must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise WorkloadError(f"{where}: field 'step' must be an integer, got {value!r}")
        return int(value)
    try:
        return int(value)
    except ValueError:
        raise WorkloadError(f"{where}: field 'step' must be an integer, got {value!r}") from None


def _bool_value(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no", ""):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise WorkloadError(f"{where}: field 'timed_out' must be true/false, got {value!r}")


def read_trace(path: Path) -> list[dict[str, Any]]:
    """Validated records `{"duration_s", "task", "step", "timed_out"}` in file order."""
    if path.is_dir():
        raise WorkloadError(f"trace file {path} is a folder (expected a JSONL or CSV trace)")
    if not path.is_file():
        raise WorkloadError(f"trace file {path} not found")
    try:
        raw = _raw_records(path)
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not UTF-8 text (expected a JSONL or CSV trace)") from None
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror}") from None
    if not raw:
        raise WorkloadError(f"{path}: trace has no executions")
    records = [_trace_record(obj, where) for where, obj in raw]
    for field in ("step", "trajectories"):
        present = sum(r[field] is not None for r in records)
        if 0 < present < len(records):
            raise WorkloadError(
                f"{path}: field {field!r} is on {present} of {len(records)} records; give it on all or none"
            )
    return records


def _raw_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(location, fields) of every record of a CSV or JSONL trace, unvalidated."""
    raw: list[tuple[str, dict[str, Any]]] = []
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: drops a BOM (spreadsheets)
            reader = csv.DictReader(handle)
            missing = [f for f in ("start", "end") if f not in (reader.fieldnames or [])]
            if missing:
                raise WorkloadError(f"{path}: CSV header lacks required column(s) {', '.join(missing)}")
            for line_no, row in enumerate(reader, start=2):
                if None in row:  # csv puts values beyond the header under the key None
                    raise WorkloadError(f"{path}:{line_no}: more values than header columns")
                raw.append((f"{path}:{line_no}", {k: v for k, v in row.items() if v not in (None, "")}))
    else:
        for line_no, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{path}:{line_no}: each line must be a JSON object")
            raw.append((f"{path}:{line_no}", obj))
    return raw


def _trace_record(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """One validated record `{"duration_s", "task", "step", "timed_out"}`."""
    unknown = sorted(set(obj) - set(_FIELDS) - set(_ACCEPTED))
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(_FIELDS)}")
    for field in ("start", "end"):
        if field not in obj:
            raise WorkloadError(f"{where}: required field {field!r} is missing")
    start = _time_value(obj["start"], "start", where)
    end = _time_value(obj["end"], "end", where)
    if end < start:
        raise WorkloadError(f"{where}: field 'end' ({obj['end']!r}) is before 'start' ({obj['start']!r})")
    duration_s = end - start
    if not duration_s <= MAX_DURATION_HOURS * 3600.0:  # also inf: two finite times far apart
        raise WorkloadError(
            f"{where}: execution lasts {duration_s:g} s (end - start); the simulator takes at most "
            f"{MAX_DURATION_HOURS * 3600.0:g} s ({MAX_DURATION_HOURS:,.0f} hours)"
        )
    step = obj.get("step")
    if step is not None:
        step = _step_value(step, where)
    trajectories = obj.get("trajectories")
    if trajectories is not None:
        if isinstance(trajectories, bool) or not isinstance(trajectories, (int, str)):
            raise WorkloadError(
                f"{where}: field 'trajectories' must be an integer >= 0, got {trajectories!r}"
            )
        try:
            trajectories = int(trajectories)
        except ValueError:
            raise WorkloadError(
                f"{where}: field 'trajectories' must be an integer >= 0, got {trajectories!r}"
            ) from None
        if trajectories < 0:
            raise WorkloadError(f"{where}: field 'trajectories' must be an integer >= 0, got {trajectories}")
    return {
        "duration_s": duration_s,
        "trajectories": trajectories,
        "task": None if obj.get("task") is None else str(obj["task"]),
        "step": step,
        "timed_out": _bool_value(obj.get("timed_out", False), where),
    }


def _groups_of(records: list[dict[str, Any]], group_size: int) -> list[list[dict[str, Any]]]:
    if all(r["task"] is not None for r in records):
        by_task: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            by_task.setdefault(r["task"], []).append(r)
        return list(by_task.values())
    return [records[i : i + group_size] for i in range(0, len(records), group_size)]


def replay_trace(path: Path, steps: int, group_size: int) -> tuple[np.ndarray, ...]:
    """(duration_s, batch, group, timed_out, trajectories) arrays for `steps` steps replaying `path`.

    `trajectories` is -1 for every execution when the trace does not record it.
    """
    records = read_trace(path)
    if records[0]["step"] is None:
        recorded_steps = [records]
    else:
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in records:
            by_step.setdefault(r["step"], []).append(r)
        recorded_steps = [by_step[s] for s in sorted(by_step)]
    cycles, rest = divmod(steps, len(recorded_steps))
    sizes = [len(rs) for rs in recorded_steps]
    total = cycles * sum(sizes) + sum(sizes[:rest])
    if total > MAX_EXECUTIONS:
        raise WorkloadError(
            f"{path}: {steps} steps replaying {len(records):,} executions over {len(sizes)} recorded step(s) "
            f"= {total:,} executions; the simulator samples at most {MAX_EXECUTIONS:,}"
        )
    step_groups = [_groups_of(rs, group_size) for rs in recorded_steps]
    durations, batches, groups, timed, kept = [], [], [], [], []
    group_id = 0
    for s in range(steps):
        for members in step_groups[s % len(step_groups)]:
            for r in members:
                durations.append(r["duration_s"])
                batches.append(s)
                groups.append(group_id)
                timed.append(r["timed_out"])
                kept.append(-1 if r["trajectories"] is None else r["trajectories"])
            group_id += 1
    return (
        np.asarray(durations, dtype=float),
        np.asarray(batches, dtype=np.int64),
        np.asarray(groups, dtype=np.int64),
        np.asarray(timed, dtype=bool),
        np.asarray(kept, dtype=np.int64),
    )
