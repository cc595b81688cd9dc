"""`gyre-ray report RUN_DIR`: pictures of a real run, as PNGs and one HTML page beside them.

Reads what every run leaves in its folder (`metrics.jsonl`, `trace.jsonl`, `summary.json` with the
cells' work spans and the switch events) and writes under `RUN_DIR/report/`:
- `reward.png`: mean reward per step, and per task (from the trace's per-execution rewards);
- `timeline.png`: one row per cell, what it did when (rollout / training / switching), with the
  number of executions running over time beneath (the saw-tooth of the reference paper's figure);
- `switches.png`: each role switch's latency by direction, over the run;
- `staleness.png`: the policy-version lag of trained tokens per step (max and mean);
- `eval.png`: the evaluation curve, held-out reward per task and mean, and the pass rate, against the
  updates the evaluated policy had (`eval.jsonl`; a note when the run had `run.eval_every=0`);
- `index.html`: the five pictures and a table of the step metrics.
The training job writes it at the end of every run. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

KIND_COLORS = {"rollout": "#2f6db5", "training": "#e07b1a", "switching": "#9e9e9e"}
TABLE_KEYS = ("step", "reward_mean", "valid", "executions", "calls", "loss", "grad_norm", "step_seconds")


class ReportError(ValueError):
    """The folder is not a run folder (or lacks what the report needs); the message says what is missing."""


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(run_dir: Path) -> dict[str, Any]:
    """The run's step metrics, trace rows and summary (ReportError when the folder is not a run's)."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    missing = [n for n in ("metrics.jsonl", "trace.jsonl", "summary.json") if not (run_dir / n).is_file()]
    if missing:
        raise ReportError(f"{run_dir} is not a finished run folder: no {', '.join(missing)}")
    return {
        "steps": _read_jsonl(run_dir / "metrics.jsonl"),
        "trace": _read_jsonl(run_dir / "trace.jsonl"),
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "eval": _read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").is_file() else [],
    }


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


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward(steps: list[dict[str, Any]], trace: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = [m["step"] for m in steps]
    # a step that scored no execution has no reward (None): a gap in the line, not a drop to 0
    ax.plot(xs, [_or_nan(m.get("reward_mean")) for m in steps], "o-", color="black", lw=2, label="mean")
    for task, series in sorted(rewards_by_task(trace).items()):
        ax.plot(list(series), list(series.values()), ".--", alpha=0.7, label=task)
    ax.set(xlabel="step", ylabel="reward", title="Reward per step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
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
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    top.legend(handles, list(KIND_COLORS), fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3)
    for m in summary.get("steps", []):
        if "published_at_s" in m:
            for ax in (top, bottom):
                ax.axvline(m["published_at_s"], color="black", lw=0.6, ls=":")
    times, counts = running_over_time(trace)
    bottom.step(times, counts, where="post", color="#2f6db5")
    bottom.fill_between(times, counts, step="post", alpha=0.2, color="#2f6db5")
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
        ax.text(0.5, 0.5, "no role switches in this run", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_staleness(steps: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = [m["step"] for m in steps]
    ax.bar(xs, [m.get("staleness", {}).get("max", 0) for m in steps], color="#fde3c4", label="max")
    ax.plot(xs, [m.get("staleness", {}).get("mean", 0.0) for m in steps], "o-", color="#e07b1a", label="mean")
    ax.set(xlabel="step", ylabel="versions behind", title="Staleness of trained tokens")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_eval(rounds: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    rounds = sorted(rounds, key=lambda r: r["step"])
    if rounds:
        xs = [r["step"] for r in rounds]
        ax.plot(
            xs, [_or_nan(r["reward_mean"]) for r in rounds], "o-", color="black", lw=2, label="mean reward"
        )
        for task in sorted({t for r in rounds for t in r["tasks"]}):
            points = [(r["step"], r["tasks"][task]["reward"]) for r in rounds if task in r["tasks"]]
            ax.plot(*zip(*points, strict=True), ".--", alpha=0.7, label=task)
        ax.plot(xs, [r["pass_rate"] for r in rounds], "s:", color="#2a9d4b", label="pass rate")
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no evaluation in this run (run.eval_every=0)", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set(xlabel="updates of the evaluated policy", ylabel="held-out reward / pass rate",
           title="Evaluation on held-out tasks", ylim=(-0.02, 1.02))  # fmt: skip
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def write_report(run_dir: str | Path) -> Path:
    """Write every picture and `index.html` under RUN_DIR/report/; returns the HTML page's path."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    pictures = [
        plot_reward(run["steps"], run["trace"], out / "reward.png"),
        plot_timeline(run["summary"], run["trace"], out / "timeline.png"),
        plot_switches(run["summary"], out / "switches.png"),
        plot_staleness(run["steps"], out / "staleness.png"),
        plot_eval(run["eval"], out / "eval.png"),
    ]
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(m.get(k)))}</td>" for k in TABLE_KEYS) + "</tr>"
        for m in run["steps"]
    )
    head = "".join(f"<th>{k}</th>" for k in TABLE_KEYS)
    images = "".join(f'<p><img src="{p.name}" alt="{p.stem}"></p>' for p in pictures)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>gyre-ray run {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>"
        f"<h1>Run {html.escape(run_dir.name)}</h1>{images}<table><tr>{head}</tr>{rows}</table></body></html>"
    )
    index = out / "index.html"
    index.write_text(page)
    return index


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report", help="pictures of a run: reward, cell-role timeline, switches, staleness, evaluation"
    )
    parser.add_argument("run_dir", help="a run folder (what `gyre-ray train` printed)")
    parser.set_defaults(handler=_report_command)


def _report_command(args: Any) -> int:
    import sys

    try:
        index = write_report(args.run_dir)
    except ReportError as exc:
        print(f"gyre-ray report: {exc}", file=sys.stderr)
        return 2
    print(f"gyre-ray report: {index} (and the PNGs beside it)")
    return 0
