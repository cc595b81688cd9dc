"""Resuming a run in its own folder: `gyre-ray train --resume RUN_DIR [run.steps=N ...]`.

The newest complete checkpoint (`gyre_ray.checkpoint.latest`) says where the run stopped: step S
(updates done). Before the run goes on, what the folder holds of steps >= S (a crashed segment's call
records, workspaces, metric rows and evaluation rounds after the checkpoint) is moved under
`abandoned/<time>/`, so the store never appends to an old record file and every figure counts each
step once. A step before S whose metrics row the killed driver never wrote (it died between the
checkpoint and its next poll) gets its row back from the scheduler's journal (its `published` event)
or from the checkpoint's `state.json`, before the new segment's scheduler starts the journal afresh.
When the run ends, its trace, spans and switch events are merged after those of the earlier segment
(times shifted to follow it), so `gyre-ray report` draws the whole run.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import STATE_FILE, complete_checkpoints
from gyre_ray.evaluation import EVAL_FILE
from gyre_ray.observability.metrics import WANDB_PENDING_FILE
from gyre_ray.proxy.store_files import json_lines, json_object
from gyre_ray.runtime.journal import JOURNAL_NAME

_TRAIN_ID = re.compile(r"^s(\d+)-")  # execution ids s<step>-<task>-<i> (records, workspaces)
_EVAL_ID = re.compile(r"^eval-?(\d+)")  # eval<step>-<task>-<i> records, eval-<step>/ workspace folders


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(json_lines(path))  # up to a line torn by the killed segment


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def prepare_resume(run_dir: str | Path, first_step: int) -> dict[str, Any]:
    """Set aside what the folder holds of steps >= `first_step`; returns {"moved": n, "to": folder}."""
    run_dir = Path(run_dir)
    kept_eval = [r for r in _read_jsonl(run_dir / EVAL_FILE) if r["step"] <= first_step]
    evaluated = {r["step"] for r in kept_eval}
    aside = run_dir / "abandoned" / time.strftime("%Y%m%d-%H%M%S")

    def after(name: str) -> bool:
        if m := _TRAIN_ID.match(name):
            return int(m.group(1)) >= first_step
        if m := _EVAL_ID.match(name):
            step = int(m.group(1))
            return step > first_step or step not in evaluated  # a round with no row is run again
        return False

    moved = 0
    for folder in ("records", "workspaces"):
        for path in sorted((run_dir / folder).glob("*")) if (run_dir / folder).is_dir() else []:
            if after(path.name):
                (aside / folder).mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), str(aside / folder / path.name))
                moved += 1
    metrics = run_dir / "metrics.jsonl"
    kept = [r for r in _read_jsonl(metrics) if r["step"] < first_step]
    recovered = lost_step_rows(run_dir, first_step, kept)
    if metrics.is_file() or recovered:
        _write_jsonl(metrics, sorted(kept + recovered, key=lambda r: r["step"]))
    if recovered:  # the resumed run's metrics logger sends them to wandb, which never had them
        pending = [r for r in _read_jsonl(run_dir / WANDB_PENDING_FILE) if r["step"] < first_step]
        _write_jsonl(run_dir / WANDB_PENDING_FILE, sorted(pending + recovered, key=lambda r: r["step"]))
    if (run_dir / EVAL_FILE).is_file():
        _write_jsonl(run_dir / EVAL_FILE, kept_eval)
    return {"moved": moved, "to": str(aside) if moved else None, "recovered": [r["step"] for r in recovered]}


def lost_step_rows(
    run_dir: str | Path, first_step: int, logged: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The metrics rows of steps < `first_step` that were published but are not in `logged` (the
    driver died before it polled them): from the last segment's scheduler journal (`published`
    events), else from a checkpoint's `state.json` (`metrics`, the row of the step it ends). Their
    times are moved onto the run's clock as the driver would have; each step comes back once."""
    run_dir = Path(run_dir)
    have = {int(r["step"]) for r in logged}
    header: dict[str, Any] = {}
    found: dict[int, dict[str, Any]] = {}
    for event in json_lines(run_dir / JOURNAL_NAME):  # the journal holds the last segment only
        if "run" in event:
            header, found = event["run"], {}
        elif "published" in event and isinstance(event.get("metrics"), dict):
            found[int(event["metrics"].get("step", event["published"]))] = event["metrics"]
    journaled = dict(found)
    for path in complete_checkpoints(run_dir):
        row = json_object(path / STATE_FILE, {}).get("metrics")
        if isinstance(row, dict) and "step" in row:
            found.setdefault(int(row["step"]), row)
    lost = sorted(s for s in found if s < first_step and s not in have)
    if not lost:
        return []
    segment_start = int(header.get("first_step", 0))
    offset = _journal_offset(run_dir, segment_start, journaled, logged)
    return [{**shift_step(found[s], offset), "step": s} for s in lost]


def _journal_offset(
    run_dir: Path, segment_start: int, journaled: dict[int, dict[str, Any]], logged: list[dict[str, Any]]
) -> float:
    """The seconds the driver added to the journaled segment's times: read off a step both the journal
    and metrics.jsonl hold, else what `segment_offset` gives for that segment's start (0 for step 0)."""
    for row in logged:
        twin = journaled.get(int(row["step"]))
        if twin is not None and "published_at_s" in row and "published_at_s" in twin:
            return round(float(row["published_at_s"]) - float(twin["published_at_s"]), 4)
    return segment_offset(run_dir, segment_start) if segment_start else 0.0


def earlier_steps(run_dir: str | Path, first_step: int) -> list[dict[str, Any]]:
    """The step metrics of the steps before `first_step` (from metrics.jsonl)."""
    return [r for r in _read_jsonl(Path(run_dir) / "metrics.jsonl") if r["step"] < first_step]


def earlier_trace(run_dir: str | Path, first_step: int) -> list[dict[str, Any]]:
    """The trace rows of the steps before `first_step` (from trace.jsonl)."""
    return [r for r in _read_jsonl(Path(run_dir) / "trace.jsonl") if r["step"] < first_step]


def merged_trace(
    run_dir: str | Path, first_step: int, offset: float, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The earlier segment's trace rows of steps < `first_step`, then `rows` (a segment's own, from
    its start) moved by `offset` seconds."""
    return earlier_trace(run_dir, first_step) + [shift(r, ("start", "end"), offset) for r in rows]


def segment_offset(run_dir: str | Path, first_step: int) -> float:
    """Where the resumed segment's clock starts: the end of the earlier segment's last execution or span."""
    run_dir = Path(run_dir)
    trace = earlier_trace(run_dir, first_step)
    spans = _summary(run_dir).get("spans", [])
    return max([r["end"] for r in trace] + [s[3] for s in spans], default=0.0)


def _summary(run_dir: Path) -> dict[str, Any]:
    """The earlier segment's summary.json; {} when absent, or empty or cut off (the job was killed
    while writing it: its trace and steps are still read from trace.jsonl and metrics.jsonl)."""
    return json_object(run_dir / "summary.json", {})


def shift(row: dict[str, Any], keys: tuple[str, ...], offset: float) -> dict[str, Any]:
    """`row` with the times under `keys` moved by `offset` seconds."""
    return {**row, **{k: round(row[k] + offset, 4) for k in keys if k in row}}


def shift_step(metrics: dict[str, Any], offset: float) -> dict[str, Any]:
    """A resumed segment's step metrics on the run's clock: `published_at_s` and its switch events'
    `at_s` moved by `offset` seconds."""
    moved = shift(metrics, ("published_at_s",), offset)
    if isinstance(metrics.get("switches"), list):
        moved["switches"] = [
            shift(e, ("at_s",), offset) if isinstance(e, dict) else e for e in metrics["switches"]
        ]
    return moved


def merged_costs(
    costs: dict[str, Any], steps: list[dict[str, Any]], trace: list[dict[str, Any]]
) -> dict[str, Any]:
    """A resumed run's measured costs over the whole run: its steps, and its makespan from the first
    launch to the last update published, on the run's clock (the segment's own covered only itself)."""
    merged = {**costs, "steps": len(steps)}
    published = [m["published_at_s"] for m in steps if isinstance(m.get("published_at_s"), (int, float))]
    starts = [r["start"] for r in trace if isinstance(r.get("start"), (int, float))]
    if published and starts:
        merged["makespan_s"] = round(max(published) - min(starts), 4)
    return merged


def merge_segments(
    run_dir: str | Path, first_step: int, offset: float, result: dict[str, Any]
) -> dict[str, Any]:
    """`result` (what `scheduler.run` returned for steps >= first_step) with the earlier segment's trace
    rows, spans, switch events and step metrics in front; the new times shifted by `offset`; its
    costs' steps and makespan over the whole run."""
    run_dir = Path(run_dir)
    before = _summary(run_dir)
    merged = dict(result)
    merged["trace"] = merged_trace(run_dir, first_step, offset, result["trace"])
    merged["spans"] = [tuple(s) for s in before.get("spans", []) if s[3] <= offset] + [
        (c, k, round(lo + offset, 4), round(hi + offset, 4)) for c, k, lo, hi in result["spans"]
    ]
    merged["switches"] = [e for e in before.get("switches", []) if e.get("batch", 0) < first_step] + [
        shift(e, ("at_s",), offset) for e in result["switches"]
    ]
    merged["steps"] = earlier_steps(run_dir, first_step) + [shift_step(m, offset) for m in result["steps"]]
    if isinstance(result.get("costs"), dict):
        merged["costs"] = merged_costs(result["costs"], merged["steps"], merged["trace"])
    return merged
