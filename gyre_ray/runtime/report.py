"""What a run reports: per-step staleness and overlap, the execution trace and the measured costs.

Pure functions over plain data (tested without Ray). The files follow the contract the simulator
reads (`gyre-ray simulate --trace RUN_DIR`, docs/scheduling.md):
- `RUN_DIR/trace.jsonl`: one object per execution: start, end (seconds since the run started), task,
  step, timed_out, exec_id, calls, tokens, trajectories, dropped, version, reward (null when dropped),
  runner (the actor that ran it).
- `RUN_DIR/costs.json`: the run's measured costs (`COST_KEYS`).
And, for people, what the run recovered from (`recovery_lines`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gyre_ray.run_folder import replace_jsonl, replace_text
from gyre_ray.runtime.runners import executor_name
from gyre_ray.sim.replay import COST_NUMBERS, INT_KEYS

# costs.json's keys, in order: the simulator's replay (`gyre_ray.sim.replay`) reads exactly these.
COST_KEYS = (*INT_KEYS[:4], "policy", INT_KEYS[4], "async_train_cells", *COST_NUMBERS)


def staleness_summary(trained_version: int, token_versions: Iterable[Mapping[int, int]]) -> dict[str, Any]:
    """Histogram {lag: loss tokens} of the tokens trained at `trained_version`, with max and mean lag."""
    hist: dict[int, int] = {}
    for counts in token_versions:
        for version, n in counts.items():
            lag = trained_version - int(version)
            hist[lag] = hist.get(lag, 0) + int(n)
    total = sum(hist.values())
    return {
        "hist": {str(k): hist[k] for k in sorted(hist)},
        "max": max(hist) if hist else 0,
        "mean": sum(k * n for k, n in hist.items()) / total if total else 0.0,
        "tokens": total,
    }


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of closed intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted((a, b) for a, b in intervals if b > a):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def overlap_seconds(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Seconds during which some interval of `a` and some interval of `b` both run."""
    total = 0.0
    xs, ys = merge_intervals(a), merge_intervals(b)
    i = j = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def write_trace(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """`RUN_DIR/trace.jsonl`, one execution per line, in launch order."""
    path = Path(run_dir) / "trace.jsonl"
    replace_jsonl(path, rows)  # whole: after a resume it holds the earlier segments' rows too
    return path


def write_costs(run_dir: Path, costs: Mapping[str, Any]) -> Path:
    """`RUN_DIR/costs.json` with exactly `COST_KEYS` (a missing key is an error, not a silent default)."""
    missing = [k for k in COST_KEYS if k not in costs]
    if missing:
        raise KeyError(f"costs.json needs {', '.join(missing)}")
    path = Path(run_dir) / "costs.json"
    replace_text(path, json.dumps({k: costs[k] for k in COST_KEYS}, indent=2))
    return path


def utilisation(
    phases: Iterable[tuple[str, str, float, float]], makespan_s: float
) -> dict[str, dict[str, float]]:
    """Per cell, the share of `makespan_s` spent rolling out, training, switching and idle.

    `phases`: (cell, kind, start, end) with kind one of rollout / training / switching; the rest is idle.
    A rollout cell that hosts no execution counts as idle (`rollout` spans come from the ledger).
    """
    shares: dict[str, dict[str, float]] = {}
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for cell, kind, lo, hi in phases:
        spans.setdefault((cell, kind), []).append((max(0.0, lo), min(makespan_s, hi)))
    for (cell, kind), items in spans.items():
        busy = sum(hi - lo for lo, hi in merge_intervals(items))
        shares.setdefault(cell, {"rollout": 0.0, "training": 0.0, "switching": 0.0})[kind] = (
            busy / makespan_s if makespan_s > 0 else 0.0
        )
    for share in shares.values():
        share["idle"] = max(0.0, 1.0 - share["rollout"] - share["training"] - share["switching"])
    return {cell: {k: round(v, 4) for k, v in share.items()} for cell, share in sorted(shares.items())}


def recovery_lines(summary: Mapping[str, Any]) -> list[str]:
    """What a run recovered from, one line per kind (none for a run without faults): cells lost and
    restarted, executions started again after their executor died, groups processed again, scheduler
    actor restarts. `summary` holds the run result's `faults`, `runner_losses`, `scheduler_restarts`."""
    lines = []
    faults = summary.get("faults") or []
    cells = Counter(f["cell"] for f in faults if "cell" in f)
    if cells:
        lines.append("cells lost and restarted: " + ", ".join(f"{c} x{n}" for c, n in sorted(cells.items())))
    losses = summary.get("runner_losses") or []
    if losses:
        actors = Counter(loss.get("actor") or executor_name(loss["runner"]) for loss in losses)
        lines.append(
            f"{len(losses)} execution(s) started again after their executor died ("
            + ", ".join(f"{a} x{n}" for a, n in sorted(actors.items()))
            + ")"
        )
    groups = [f["group_processed_again"] for f in faults if "group_processed_again" in f]
    if groups:
        lines.append(f"{len(groups)} group(s) processed again after `workers` died: {', '.join(groups)}")
    restarts = summary.get("scheduler_restarts") or []
    if restarts:
        reattached = sum(r.get("executions_reattached", 0) for r in restarts)
        again = sum(r.get("executions_relaunched", 0) for r in restarts)
        lines.append(
            f"scheduler actor restarted {len(restarts)} time(s): {reattached} execution(s) reattached, "
            f"{again} started again"
        )
    return lines
