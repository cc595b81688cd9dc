"""Resuming a run in its own folder: `gyre-ray train --resume RUN_DIR [run.steps=N ...]`.

The newest complete checkpoint (`gyre_ray.checkpoint.latest`) says where the run stopped: step S
(updates done). Before the run goes on, what the folder holds of steps >= S (a crashed segment's call
records, workspaces, metric rows and evaluation rounds after the checkpoint) is moved under
`abandoned/<time>/`, so the store never appends to an old record file and every figure counts each
step once. A step before S whose metrics row the killed driver never wrote (it died between the
checkpoint and its next poll) gets its row back from the scheduler's journal (its `published` event)
or from the checkpoint's `state.json`, before the new segment's scheduler starts the journal afresh;
so do the trace rows of that segment's executions of steps before S (it wrote no trace.jsonl: it
was killed before its end), from the journal's launches, ends and group figures.
When the run ends, its trace, spans and switch events are merged after those of the earlier segment
(times shifted to follow it), so `gyre-ray report` draws the whole run.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from gyre_ray.agents.relaunch import planned_id
from gyre_ray.checkpoint import STATE_FILE, complete_checkpoints
from gyre_ray.evaluation import EVAL_FILE
from gyre_ray.observability.metrics import WANDB_PENDING_FILE
from gyre_ray.proxy.store_files import json_lines, json_object
from gyre_ray.run_folder import replace_jsonl
from gyre_ray.runtime.journal import JournalState, RunJournal
from gyre_ray.runtime.recorder import trace_row
from gyre_ray.runtime.runners import executor_name

_TRAIN_ID = re.compile(r"^s(\d+)-")  # execution ids s<step>-<task>-<i> (records, workspaces)
_EVAL_ID = re.compile(r"^eval-?(\d+)")  # eval<step>-<task>-<i> records, eval-<step>/ workspace folders


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(json_lines(path))  # up to a line torn by the killed segment


def prepare_resume(run_dir: str | Path, first_step: int) -> dict[str, Any]:
    """Set aside what the folder holds of steps >= `first_step` (records and workspaces moved, rows of
    metrics.jsonl, trace.jsonl and eval.jsonl copied, under `abandoned/<time>/`); put back the metrics
    and trace rows of steps before it that a killed segment never wrote. Returns {"moved": entries,
    "rows_set_aside": rows, "to": folder, "recovered": [steps whose metrics row came back],
    "recovered_trace": trace rows that came back}."""
    run_dir = Path(run_dir)
    kept_eval = [r for r in _read_jsonl(run_dir / EVAL_FILE) if r["step"] <= first_step]
    evaluated = {r["step"] for r in kept_eval}
    aside = run_dir / "abandoned" / time.strftime("%Y%m%d-%H%M%S")

    def after(name: str) -> bool:
        name = planned_id(name)  # (r1.<id>: started again after its executor died)
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
    journal = RunJournal.read(run_dir)  # the journal holds the last segment only
    recovered = lost_step_rows(run_dir, first_step, kept, journal)
    kept_trace = earlier_trace(run_dir, first_step)
    set_aside_rows = 0
    for name, last_kept in (
        ("metrics.jsonl", first_step - 1),
        ("trace.jsonl", first_step - 1),
        (EVAL_FILE, first_step),
    ):
        rows = [r for r in _read_jsonl(run_dir / name) if r["step"] > last_kept]  # moved aside
        if rows:
            aside.mkdir(parents=True, exist_ok=True)
            replace_jsonl(aside / name, rows)
            set_aside_rows += len(rows)
    recovered_trace = lost_trace_rows(
        run_dir, first_step, kept_trace, journal
    )  # reads metrics.jsonl as it was
    if (run_dir / "trace.jsonl").is_file() or recovered_trace:  # (a later attempt's ids are the same)
        replace_jsonl(run_dir / "trace.jsonl", sorted(kept_trace + recovered_trace, key=lambda r: r["start"]))
    if metrics.is_file() or recovered:
        replace_jsonl(metrics, sorted(kept + recovered, key=lambda r: r["step"]))
    if recovered:  # the resumed run's metrics logger sends them to wandb, which never had them
        pending = [r for r in _read_jsonl(run_dir / WANDB_PENDING_FILE) if r["step"] < first_step]
        replace_jsonl(run_dir / WANDB_PENDING_FILE, sorted(pending + recovered, key=lambda r: r["step"]))
    if (run_dir / EVAL_FILE).is_file():
        replace_jsonl(run_dir / EVAL_FILE, kept_eval)
    return {
        "moved": moved,
        "rows_set_aside": set_aside_rows,
        "to": str(aside) if moved or set_aside_rows else None,
        "recovered": [r["step"] for r in recovered],
        "recovered_trace": len(recovered_trace),
    }


def lost_step_rows(
    run_dir: str | Path, first_step: int, logged: list[dict[str, Any]], state: JournalState | None = None
) -> list[dict[str, Any]]:
    """The metrics rows of steps < `first_step` that were published but are not in `logged` (the
    driver died before it polled them): from the last segment's scheduler journal (`published`
    events), else from a checkpoint's `state.json` (`metrics`, the row of the step it ends). Their
    times are moved onto the run's clock as the driver would have; each step comes back once. `state`:
    the run's journal when the caller read it already."""
    run_dir = Path(run_dir)
    have = {int(r["step"]) for r in logged}
    state = state if state is not None else RunJournal.read(run_dir)
    header = state.header if state is not None else {}
    found = _journaled_steps(state)
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


def lost_trace_rows(
    run_dir: str | Path, first_step: int, kept_rows: list[dict[str, Any]], state: JournalState | None = None
) -> list[dict[str, Any]]:
    """The trace.jsonl rows (`recorder.trace_row`) of the journaled segment's executions of steps <
    `first_step` that it published, which `kept_rows` (trace.jsonl's rows) lacks by `exec_id`: the
    segment was killed before it wrote its trace. Built from the journal's launches, ends and group
    figures as the recorder builds them (an execution with no end ends at the segment's last publish)
    and moved onto the run's clock as `lost_step_rows` moves metrics. A journal written before
    launches carried their trace facts gives none. `state`: as for `lost_step_rows`."""
    run_dir = Path(run_dir)
    state = state if state is not None else RunJournal.read(run_dir)
    if state is None:
        return []
    have = {r.get("exec_id") for r in kept_rows}
    published = {int(event["batch"]) for event in state.published}
    lost = [
        (e, facts)
        for e, facts in sorted(state.launches.items())
        if int(facts["step"]) < first_step
        and int(facts["step"]) in published
        and facts["execution_id"] not in have
    ]
    if not lost:
        return []
    journaled = _journaled_steps(state)
    last_publish = state.last_publish_s  # where the recorder ends an execution that never ended
    offset = _journal_offset(
        run_dir, int(state.header.get("first_step", 0)), journaled, earlier_steps(run_dir, first_step)
    )
    rows = []
    for e, facts in lost:
        o = state.outcomes.get(e)
        outcome = (
            (bool(o.get("timed_out")), bool(o.get("valid")), float(o.get("reward") or 0.0)) if o else None
        )
        row = trace_row(
            (float(facts["at_s"]), state.ended_at.get(e, last_publish)),
            facts["group"],
            int(facts["step"]),
            facts["execution_id"],
            int(facts["version"]),
            outcome,
            state.exec_stats.get(facts["execution_id"], {}),
            executor_name(state.runners.get(e)),
        )
        rows.append(shift(row, ("start", "end"), offset))
    return rows


def _journaled_steps(state: JournalState | None) -> dict[int, dict[str, Any]]:
    """The metrics row of each step the journaled segment published, by step."""
    if state is None:
        return {}
    return {
        int(m.get("step", event["batch"])): m
        for event in state.published
        if isinstance(m := event["metrics"], dict)
    }


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
    """Where the resumed segment's clock starts: the end of the earlier segments' last execution, span
    or published step."""
    run_dir = Path(run_dir)
    trace = earlier_trace(run_dir, first_step)
    spans = _summary(run_dir).get("spans", [])
    published = [m.get("published_at_s") for m in earlier_steps(run_dir, first_step)]
    published = [t for t in published if isinstance(t, (int, float))]
    return max([r["end"] for r in trace] + [s[3] for s in spans] + published, default=0.0)


# A resumed segment moves the earlier segment's summary.json here once its restore succeeded: until the
# segment writes its own, the folder holds no proof that the run ended (`gyre-ray runs`, the report).
EARLIER_SUMMARY = "summary.earlier.json"


def set_summary_aside(run_dir: Path) -> None:
    """Move summary.json to `EARLIER_SUMMARY` (where `_summary` reads it); none: nothing to do."""
    if (run_dir / "summary.json").is_file():
        (run_dir / "summary.json").replace(run_dir / EARLIER_SUMMARY)


def _summary(run_dir: Path) -> dict[str, Any]:
    """The earlier segment's summary.json (or, once a resume set it aside, `EARLIER_SUMMARY`); {} when
    absent, or empty or cut off (the job was killed while writing it: its trace and steps are still
    read from trace.jsonl and metrics.jsonl)."""
    path = run_dir / "summary.json"
    return json_object(path if path.is_file() else run_dir / EARLIER_SUMMARY, {})


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
