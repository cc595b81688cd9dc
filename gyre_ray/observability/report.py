"""`gyre-ray report RUN_DIR [--out DIR]`: pictures of a run, as PNGs and one HTML page beside them.

Reads what every run leaves in its folder (`metrics.jsonl`, `trace.jsonl`, `summary.json` with the
cells' work spans and the switch events) and writes under `RUN_DIR/report/` (or `--out`):
- `reward.png`: mean reward per step, and per task (from the trace's per-execution rewards);
- `timeline.png`: one row per cell, what it did when (rollout / training / switching), with the
  number of executions running over time beneath (the saw-tooth of the reference paper's figure);
- `switches.png`: each role switch's latency by direction, over the run;
- `staleness.png`: the policy-version lag of trained tokens per step (max and mean; a step that
  trained no token is a gap, not a lag of 0);
- `eval.png`: the evaluation curve, held-out reward per task and mean, and the pass rate, against the
  updates the evaluated policy had (`eval.jsonl`, else the newest `evals/<time>/eval.jsonl` that
  `gyre-ray eval --run` wrote; a note when there is none);
- `index.html`: the pictures and a table of the step metrics.
A run that did not finish (killed, crashed) gets what its files allow: a torn last line of a JSONL
file is skipped, an empty or torn `summary.json` counts as absent, and the pictures that need a
missing file are left out with a note saying which and why (and their files from an earlier report
removed); a run with `failed.json` gets a first note with its error, and a picture with nothing to
show says why in it. A JSONL line the job never writes (not JSON before the last line, not an
object, or a field the pictures read holding the wrong kind of value: a `step` that is no integer, a
`reward_mean` or `start` that is no number, NaN and infinity included, ...) is a ReportError naming
file, line and field; a `summary.json` whose spans or switches are not what the job writes is left
out like a torn one, with a note naming the field. The training job writes the report at the end of
every run. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre_ray.json_values import is_int, is_number, short
from gyre_ray.proxy.store_files import json_object
from gyre_ray.train import FAILED_FILE

KIND_COLORS = {"rollout": "#2f6db5", "training": "#e07b1a", "switching": "#9e9e9e"}
TABLE_KEYS = ("step", "reward_mean", "valid", "executions", "calls", "loss", "grad_norm", "step_seconds")


class ReportError(ValueError):
    """The folder is not a run folder (or lacks what the report needs); the message says what is missing."""


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


_KINDS = {
    "int": (is_int, "an integer"),
    "number": (is_number, "a number"),
    "number|null": (lambda v: v is None or is_number(v), "a number or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def _field_problem(row: dict[str, Any], key: str, kind: str, required: bool = False) -> str | None:
    """What is wrong with `row[key]` (None when it is absent and not required, or of `kind`)."""
    if key not in row:
        return f"lacks the field {key}" if required else None
    check, wanted = _KINDS[kind]
    return None if check(row[key]) else f"{key} {short(row[key])} is not {wanted}"


def _step_row_problem(row: dict[str, Any]) -> str | None:
    """metrics.jsonl: the fields the reward, staleness and per-task pictures read."""
    return (
        _field_problem(row, "step", "int", required=True)
        or _field_problem(row, "reward_mean", "number|null")
        or _map_problem(row, "staleness", ("max", "mean", "tokens"), "number", nullable=True)
        or _map_problem(row, "reward_by_task", None, "number|null", nullable=True)
    )


def _trace_row_problem(row: dict[str, Any]) -> str | None:
    """trace.jsonl: the fields the timeline and the per-task rewards read."""
    problem = (
        _field_problem(row, "start", "number", required=True)
        or _field_problem(row, "end", "number", required=True)
        or _field_problem(row, "step", "int", required=True)
        or _field_problem(row, "reward", "number|null")
        or _field_problem(row, "dropped", "bool")
    )
    if problem is None and not row.get("dropped") and row.get("reward") is not None:
        problem = _field_problem(row, "task", "string", required=True)  # a scored execution's task
    return problem


def _eval_row_problem(row: dict[str, Any]) -> str | None:
    """eval.jsonl: the fields the evaluation picture reads."""
    problem = (
        _field_problem(row, "step", "int", required=True)
        or _field_problem(row, "reward_mean", "number|null", required=True)
        or _field_problem(row, "pass_rate", "number", required=True)
        or _field_problem(row, "tasks", "object", required=True)
    )
    if problem is None:
        for task, figures in row["tasks"].items():
            if not isinstance(figures, dict):
                return f"tasks.{task} {short(figures)} is not an object"
            if (inner := _field_problem(figures, "reward", "number|null", required=True)) is not None:
                return f"tasks.{task}: {inner}"
    return problem


def _summary_problem(summary: dict[str, Any]) -> str | None:
    """summary.json: what the timeline and switches pictures read (spans, utilisation, steps'
    published_at_s, switches), or None when it is what the job writes."""
    spans, cells = summary.get("spans") or [], summary.get("utilisation") or {}
    if not isinstance(spans, list):
        return f"spans {short(spans)} is not a list"
    for k, span in enumerate(spans):
        if not (
            isinstance(span, list) and len(span) == 4 and isinstance(span[0], str)
            and isinstance(span[1], str) and is_number(span[2]) and is_number(span[3])
        ):  # fmt: skip
            return f"spans[{k}] {short(span)} is not [cell, kind, start, end]"
    if not isinstance(cells, dict):
        return f"utilisation {short(cells)} is not an object"
    for key in ("steps", "switches"):
        items = summary.get(key) or []
        if not isinstance(items, list):
            return f"{key} {short(items)} is not a list"
        for k, item in enumerate(items):
            if not isinstance(item, dict):
                return f"{key}[{k}] {short(item)} is not an object"
            if key == "steps":
                problem = _field_problem(item, "published_at_s", "number")
            elif "seconds" in item:  # a switch that ended: drawn
                problem = (
                    _field_problem(item, "seconds", "number")
                    or _field_problem(item, "at_s", "number", required=True)
                    or _field_problem(item, "direction", "string", required=True)
                )
            else:
                problem = None
            if problem is not None:
                return f"{key}[{k}]: {problem}"
    return None


def _map_problem(
    row: dict[str, Any], key: str, names: tuple[str, ...] | None, kind: str, nullable: bool = False
) -> str | None:
    """What is wrong with the object `row[key]` (absent, or null where `nullable`, is fine): not an
    object, or one of its values (`names`, default all) not of `kind`."""
    value = row.get(key)
    if value is None and (nullable or key not in row):
        return None
    if not isinstance(value, dict):
        return f"{key} {short(value)} is not an object"
    check, wanted = _KINDS[kind]
    for name in names if names is not None else list(value):
        if name in value and not check(value[name]):
            return f"{key}.{name} {short(value[name])} is not {wanted}"
    return None


def _read_jsonl(
    path: Path, notes: list[str], problem: Callable[[dict[str, Any]], str | None] | None = None
) -> list[dict[str, Any]]:
    """The JSON objects of an append-only file, one per line. A torn last line (its writer was killed
    mid-write) is skipped with a note; a bad line elsewhere, or a line whose fields `problem` finds
    wrong (what the job never writes), is a ReportError naming file, line and field."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not UTF-8 text (is this a JSONL file?)") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    rows: list[dict[str, Any]] = []
    for n, line in numbered:
        try:
            row = json.loads(line)
        except RecursionError:  # nested deeper than the parser goes: no line the job writes
            raise ReportError(f"{path}:{n}: not a JSON line (nested too deep)") from None
        except ValueError as exc:
            if n == numbered[-1][0]:
                notes.append(f"skipped the cut-off last line of {path.name} (its writer was killed)")
                break
            raise ReportError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}:{n}: not a JSON object")
        if problem is not None and (why := problem(row)) is not None:
            raise ReportError(f"{path}:{n}: {why}")
        rows.append(row)
    return rows


def _newest_eval(run_dir: Path) -> Path | None:
    """The newest `RUN_DIR/evals/<time>/eval.jsonl` (`gyre-ray eval --run`), or None."""
    found = sorted((run_dir / "evals").glob("*/eval.jsonl")) if (run_dir / "evals").is_dir() else []
    return found[-1] if found else None


def load_run(run_dir: Path) -> dict[str, Any]:
    """The run's step metrics, trace rows, summary (None when absent or torn), evaluation rounds and
    `notes` (what was skipped or used instead); ReportError when there is nothing to draw."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    names = ("metrics.jsonl", "trace.jsonl", "summary.json")
    missing = [n for n in names if not (run_dir / n).is_file()]
    if "metrics.jsonl" in missing:
        raise ReportError(f"{run_dir}: nothing to draw: no {', '.join(missing)} (is it a run folder?)")
    notes: list[str] = []
    steps = _read_jsonl(run_dir / "metrics.jsonl", notes, _step_row_problem)
    trace = (
        _read_jsonl(run_dir / "trace.jsonl", notes, _trace_row_problem)
        if "trace.jsonl" not in missing
        else None
    )
    summary = json_object(run_dir / "summary.json")  # None: absent, empty or cut off
    odd = _summary_problem(summary) if summary is not None else None
    if not steps and not trace and summary is None:
        raise ReportError(f"{run_dir}: nothing to draw yet: metrics.jsonl holds no step")
    eval_file = run_dir / "eval.jsonl"
    rounds = _read_jsonl(eval_file, notes, _eval_row_problem) if eval_file.is_file() else []
    if not rounds and (newest := _newest_eval(run_dir)) is not None:
        rounds = _read_jsonl(newest, notes, _eval_row_problem)
        notes.append(f"eval.png from {newest.relative_to(run_dir)} (the run itself has no evaluation round)")
    if odd is not None:  # what the job never writes: read like a torn one
        summary = None
        notes.insert(0, f"left out timeline.png and switches.png (summary.json: {odd})")
    elif summary is None:
        why = "no summary.json" if "summary.json" in missing else "summary.json is empty or cut off"
        notes.insert(0, f"left out timeline.png and switches.png ({why}: the run did not finish)")
    elif trace is None:
        notes.insert(0, "timeline.png without the executions running (no trace.jsonl)")
    if not steps:
        notes.insert(0, "reward.png and staleness.png have no step to show: metrics.jsonl holds none yet")
    if (run_dir / FAILED_FILE).is_file():
        error = json_object(run_dir / FAILED_FILE, {}).get("error")
        said = f": {error if len(error) <= 300 else error[:297] + '...'}" if isinstance(error, str) else ""
        notes.insert(0, f"the run stopped before its end ({FAILED_FILE}){said}")
    return {"steps": steps, "trace": trace, "summary": summary, "eval": rounds, "notes": notes}


def running_over_time(trace: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """Step function of executions running: (times, counts) from each execution's start and end."""
    events = sorted([(r["start"], 1) for r in trace] + [(r["end"], -1) for r in trace])
    times, counts, running = [0.0], [0], 0
    for t, delta in events:
        running += delta
        times.append(t)
        counts.append(running)
    return times, counts


def rewards_by_task(trace: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Mean reward per (task name, step) over scored executions (task names without their step prefix)."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in trace:
        if r.get("dropped") or r.get("reward") is None:
            continue
        task = re.sub(r"^s\d+-", "", str(r["task"]))  # the job names groups s<step>-<task>
        sums[task][int(r["step"])].append(float(r["reward"]))
    return {t: {s: sum(v) / len(v) for s, v in sorted(steps.items())} for t, steps in sums.items()}


def step_rewards_by_task(steps: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Mean reward per (task name, step) from the step metrics' `reward_by_task` (a run with no trace)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for m in steps:
        for task, reward in (m.get("reward_by_task") or {}).items():
            if reward is not None:
                out[task][int(m["step"])] = float(reward)
    return dict(out)


def task_rewards(trace: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """`rewards_by_task` of the trace, with the steps it lacks from the metrics' `reward_by_task`: a
    killed run has no trace, a resumed segment in progress (or killed) the earlier segments' only."""
    by_task = rewards_by_task(trace)
    traced = {int(r["step"]) for r in trace if isinstance(r.get("step"), int)}
    for task, series in step_rewards_by_task([m for m in steps if m.get("step") not in traced]).items():
        by_task[task] = dict(sorted({**by_task.get(task, {}), **series}.items()))
    return by_task


def unscored_task_steps(trace: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, set[int]]:
    """The steps at which each task ran but scored no execution (every one dropped): gaps in its line,
    not steps it skipped (a task that was not sampled at a step has no point there and no gap)."""
    ran: dict[str, set[int]] = defaultdict(set)
    scored: dict[str, set[int]] = defaultdict(set)
    for r in trace:
        if isinstance(r.get("task"), str):
            task = re.sub(r"^s\d+-", "", r["task"])
            ran[task].add(int(r["step"]))
            if not r.get("dropped") and r.get("reward") is not None:
                scored[task].add(int(r["step"]))
    for m in steps:
        for task, reward in (m.get("reward_by_task") or {}).items():
            ran[task].add(int(m["step"]))
            if reward is not None:
                scored[task].add(int(m["step"]))
    return {task: ran[task] - scored[task] for task in ran if ran[task] - scored[task]}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _step_axis(ax: Any, xs: list[int]) -> None:
    """Whole steps on the x axis; one step alone gets room around it (matplotlib would tick -0.04 to 0.04)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if not xs or min(xs) == max(xs):
        at = xs[0] if xs else 0
        ax.set_xlim(at - 0.5, at + 0.5)
    if not xs:  # no step at all: a lone tick 0 would name a step that is not there
        ax.set_xticks([])


def _legend_outside(ax: Any) -> None:
    """The legend right of the plot, where it covers no line however many tasks it names."""
    entries = len(ax.get_legend_handles_labels()[1])
    if entries:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  ncol=1 + (entries - 1) // 16, frameon=False)  # fmt: skip


def _say(ax: Any, text: str, corner: bool = False) -> None:
    """Why a plot holds no data, in its middle, or (`corner`) why it lacks some, in its top left corner."""
    box = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85}  # legible over grid and marker lines
    if corner:
        ax.text(0.01, 0.97, text, ha="left", va="top", transform=ax.transAxes, fontsize=7, bbox=box)
    else:
        ax.text(
            0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True, bbox=box
        )


def _steps_named(steps: list[int], limit: int = 8) -> str:
    named = ", ".join(map(str, steps[:limit]))
    return named + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def plot_reward(steps: list[dict[str, Any]], trace: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = [m["step"] for m in steps]
    # a step that scored no execution has no reward (None): a gap in the line, not a drop to 0
    ys = [_or_nan(m.get("reward_mean")) for m in steps]
    ax.plot(xs, ys, "o-", color="black", lw=2, label="mean")
    by_task = task_rewards(trace, steps)
    gaps = unscored_task_steps(trace, steps)
    for task, series in sorted(by_task.items()):
        # a step at which the task ran but scored nothing breaks its line (the mean's gap, too)
        points = sorted({**{s: float("nan") for s in gaps.get(task, ())}, **series}.items())
        ax.plot([s for s, _ in points], [y for _, y in points], ".--", alpha=0.7, label=task)
    if not steps:
        _say(ax, "no step logged yet (metrics.jsonl holds none)", corner=bool(by_task))
    elif all(math.isnan(y) for y in ys):
        _say(ax, "no step scored an execution (metrics.jsonl: drop_reasons says why each was dropped)")
    ax.set(xlabel="step", ylabel="reward", title="Reward per step")
    _step_axis(ax, xs + [s for series in by_task.values() for s in series])
    ax.grid(alpha=0.3)
    if steps or by_task:
        _legend_outside(ax)
    return _save(fig, path)


def plot_timeline(summary: dict[str, Any], trace: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    spans = summary.get("spans") or []
    cells = sorted({s[0] for s in spans} | set(summary.get("utilisation", {})))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 1.0 + 0.5 * max(1, len(cells)) + 2.2), sharex=True,
        gridspec_kw={"height_ratios": [max(1, len(cells)), 3]},
    )  # fmt: skip
    for cell, kind, lo, hi in spans:
        row = cells.index(cell)
        top.barh(row, hi - lo, left=lo, height=0.7, color=KIND_COLORS.get(kind, "#cccccc"))
    top.set_yticks(range(len(cells)), cells)
    top.invert_yaxis()
    top.set_title("What each cell did, and the executions running", loc="left", fontsize=10)
    handles: list[Any] = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    labels = list(KIND_COLORS)
    published = [m["published_at_s"] for m in summary.get("steps", []) if "published_at_s" in m]
    for at in published:
        for ax in (top, bottom):
            ax.axvline(at, color="black", lw=0.6, ls=":")
    if published:  # the dotted lines, named: else nothing says what they mark
        handles.append(plt.Line2D([], [], color="black", lw=0.8, ls=":"))
        labels.append("update published")
    top.legend(handles, labels, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles))
    if trace:
        times, counts = running_over_time(trace)
        bottom.step(times, counts, where="post", color="#2f6db5")
        bottom.fill_between(times, counts, step="post", alpha=0.2, color="#2f6db5")
    else:  # not a flat 0 on an axis of -0.04 to 0.04 executions: unknown, and said so
        _say(bottom, "no execution in trace.jsonl (absent or empty): the executions running are unknown")
        bottom.set_yticks([])
    bottom.set(xlabel="seconds since the first launch", ylabel="executions running")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def plot_switches(summary: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    by_direction: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in summary.get("switches", []):
        if "seconds" in e:
            by_direction[e["direction"]].append((e["at_s"], e["seconds"]))
    for direction, points in sorted(by_direction.items()):
        ax.plot(*zip(*points, strict=True), "o", label=f"{direction} ({len(points)})")
    ax.set(xlabel="seconds since the first launch", ylabel="switch latency (s)", title="Role switches")
    ax.grid(alpha=0.3)
    if by_direction:
        ax.legend(fontsize=8)
    else:
        _say(ax, "no role switches in this run")
    return _save(fig, path)


def _trained_staleness(m: dict[str, Any]) -> dict[str, Any] | None:
    """A step's staleness figures, or None where it trained no token (skipped: nothing scored): such a
    step has no lag at all, which its logged max 0 and mean 0.0 would show as on-policy."""
    staleness = m.get("staleness")
    return staleness if staleness and staleness.get("tokens", 1) != 0 else None


def plot_staleness(steps: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    xs = [m["step"] for m in steps]
    figures = [_trained_staleness(m) for m in steps]
    trained = [(x, f) for x, f in zip(xs, figures, strict=True) if f is not None]
    ax.bar([x for x, _ in trained], [f.get("max", 0) for _, f in trained], color="#fde3c4", label="max")
    means = [_or_nan(f.get("mean", 0.0)) if f is not None else float("nan") for f in figures]
    ax.plot(xs, means, "o-", color="#e07b1a", label="mean")  # a gap at a step that trained nothing
    # a row without staleness figures (e.g. an update a restarted scheduler recovered) is a gap too,
    # but not one that trained nothing: only `tokens: 0` says that
    untrained = [m["step"] for m in steps if (m.get("staleness") or {}).get("tokens", 1) == 0]
    unknown = [x for x, m, f in zip(xs, steps, figures, strict=True) if f is None and x not in untrained]
    if not steps:
        _say(ax, "no step logged yet (metrics.jsonl holds none)")
    elif not trained and not unknown:
        _say(ax, "no step trained a token (nothing scored: metrics.jsonl's skipped says why)")
    elif untrained or unknown:
        notes = [f"no token trained at step {_steps_named(untrained)}"] if untrained else []
        notes += [f"no staleness logged at step {_steps_named(unknown)}"] if unknown else []
        _say(ax, "; ".join(notes), corner=True)
    top = max((f.get("max", 0) for _, f in trained), default=0)
    ax.set(xlabel="step", ylabel="versions behind", title="Staleness of trained tokens")
    ax.set_ylim(-0.03 * max(1, top), max(1, top) * 1.15)  # a lag is never negative: no tick below 0
    _step_axis(ax, xs)
    ax.grid(alpha=0.3)
    if trained:
        _legend_outside(ax)
    return _save(fig, path)


def plot_eval(rounds: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    rounds = sorted(rounds, key=lambda r: r["step"])
    if rounds:
        xs = [r["step"] for r in rounds]
        ax.plot(
            xs, [_or_nan(r["reward_mean"]) for r in rounds], "o-", color="black", lw=2, label="mean reward"
        )
        # the tasks' colours skip tab10's green, the pass rate's (a third task's line was its twin)
        palette = [c for k, c in enumerate(plt.get_cmap("tab10").colors) if k != 2]
        for k, task in enumerate(sorted({t for r in rounds for t in r["tasks"]})):
            points = [(r["step"], _or_nan(r["tasks"][task]["reward"])) for r in rounds if task in r["tasks"]]
            scored = any(not math.isnan(y) for _, y in points)  # else a legend entry with no line: say why
            ax.plot(
                *zip(*points, strict=True),
                ".--",
                alpha=0.7,
                color=palette[k % len(palette)],
                label=task if scored else f"{task} (none scored)",
            )
        ax.plot(xs, [r["pass_rate"] for r in rounds], "s:", color="#2a9d4b", label="pass rate")
        _legend_outside(ax)
    else:
        _say(ax, "no evaluation of this run (run.eval_every=0, no gyre-ray eval --run)")
    ax.set(xlabel="updates of the evaluated policy", ylabel="held-out reward / pass rate",
           title="Evaluation on held-out tasks", ylim=(-0.02, 1.02))  # fmt: skip
    _step_axis(ax, [r["step"] for r in rounds])
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def make_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the pictures the run's files allow and `index.html` under `out` (default RUN_DIR/report);
    returns the HTML page's path and the notes (what was left out and why, what was used instead)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    out = Path(out) if out is not None else run_dir / "report"
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out} is not a folder (--out names the folder to write the report in)")
    out.mkdir(parents=True, exist_ok=True)
    trace, summary = run["trace"] or [], run["summary"]
    pictures = [plot_reward(run["steps"], trace, out / "reward.png")]
    if summary is not None:
        pictures += [
            plot_timeline(summary, trace, out / "timeline.png"),
            plot_switches(summary, out / "switches.png"),
        ]
    else:  # an earlier report's pictures of these would pass for this run's (and go to wandb)
        for name in ("timeline.png", "switches.png"):
            (out / name).unlink(missing_ok=True)
    pictures += [
        plot_staleness(run["steps"], out / "staleness.png"),
        plot_eval(run["eval"], out / "eval.png"),
    ]
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(m.get(k)))}</td>" for k in TABLE_KEYS) + "</tr>"
        for m in run["steps"]
    )
    head = "".join(f"<th>{k}</th>" for k in TABLE_KEYS)
    images = "".join(f'<p><img src="{p.name}" alt="{p.stem}"></p>' for p in pictures)
    notes = "".join(f"<p><em>{html.escape(n)}</em></p>" for n in run["notes"])
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>gyre-ray run {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>"
        f"<h1>Run {html.escape(run_dir.name)}</h1>{notes}{images}<table><tr>{head}</tr>{rows}</table></body></html>"
    )
    index = out / "index.html"
    index.write_text(page)
    return index, run["notes"]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the pictures and `index.html` under `out` (default RUN_DIR/report); returns the page's path."""
    return make_report(run_dir, out)[0]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="pictures of a run: reward, cell-role timeline, switches, staleness, evaluation"
    )
    parser.add_argument("run_dir", help="a run folder (what `gyre-ray train` printed)")
    parser.add_argument("--out", default=None, help="write the report here (default: RUN_DIR/report)")
    parser.set_defaults(handler=_report_command)


def _report_command(args: Any) -> int:
    import sys

    try:
        index, notes = make_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"gyre-ray report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --out in a folder this user cannot write
        print(f"gyre-ray report: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"gyre-ray report: {index} (and the PNGs beside it)")
    for note in notes:
        print(f"gyre-ray report: {note}")
    return 0
