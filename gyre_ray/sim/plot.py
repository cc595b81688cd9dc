"""Cell-role timelines: one panel per policy, one row per cell, the saw-tooth of rollout load.

Each row shows what the cell is doing: rolling out (blue, filled to its load, so draining
executions make the saw-tooth), switching (grey), training micro-steps (orange; pale orange is a
trainer waiting for work). Vertical ticks mark optimizer updates. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre_ray.sim.timeline import SimResult

PLOT_FORMATS = ("png", "pdf", "svg")  # what `plot_path` accepts; matplotlib picks the writer by suffix


def plot_path(path: str | Path) -> Path:
    """The file a plot goes to: `path`, with `.png` added when it has no suffix.

    `ValueError` (one line) when `path` is a folder, its suffix is not one of `PLOT_FORMATS`, or its
    folder does not exist (it is not created).
    """
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{path} is a folder; give a file name such as {out / 'timeline.png'}")
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    if out.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise ValueError(f"{path}: plots are written as {', '.join(PLOT_FORMATS)}, not {out.suffix}")
    if not out.parent.is_dir():
        raise ValueError(f"{path}: folder {out.parent} does not exist")
    return out


def check_writable(out: Path) -> None:
    """`ValueError` (one line) unless a plot can be written at `out`: a file is opened there for appending
    (and removed again when it was not there before), as the check before a simulation of minutes."""
    existed = out.exists()
    try:
        with out.open("ab"):
            pass
    except OSError as exc:
        raise ValueError(f"{out}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        out.unlink(missing_ok=True)


def _time_unit(horizon_s: float) -> tuple[float, str, str, str]:
    """(seconds per unit, symbol, name, number format) of the x axis of a plot `horizon_s` long: hours
    from 1 h, minutes from 10 min, else seconds (a replayed run of minutes read "0.1 h" against a bound
    of "0.1 h" on an axis of 0.00-0.12 hours)."""
    if horizon_s >= 3600.0:
        return 3600.0, "h", "hours", ".1f"
    if horizon_s >= 600.0:
        return 60.0, "min", "minutes", ".1f"
    return 1.0, "s", "seconds", ".0f"


_COLORS = {
    "rollout": "#dbe7f3",
    "load": "#2f6db5",
    "to_train": "#9e9e9e",
    "to_rollout": "#9e9e9e",
    "train": "#fde3c4",
    "busy": "#e07b1a",
}


def plot_timelines(
    results: Sequence[SimResult],
    path: str | Path,
    capacity_per_cell: float,
    title: str = "",
    max_hours: float | None = None,
) -> Path:
    """Draw every result's cell-role timeline into one image at `plot_path(path)` (hours on the x axis,
    minutes or seconds for a plot shorter than 1 h or 10 min); returns the file written. `max_hours`, if
    given, must be finite and > 0 (ValueError)."""
    if max_hours is not None and not (max_hours > 0 and math.isfinite(max_hours * 3600.0)):
        raise ValueError(f"max_hours must be > 0 and finite in seconds, got {max_hours}")
    out = plot_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(results)
    n_cells = max(r.n_cells for r in results)
    longest_s = max(r.makespan_s for r in results)
    horizon_s = max_hours * 3600.0 if max_hours else longest_s
    horizon_s = horizon_s if horizon_s > 0 else 1.0  # runs that took no time: an axis of 1 s, not 0
    unit = _time_unit(horizon_s)  # the axis's; the titles' is the whole runs' (--plot-hours zooms the axis)
    fig, axes = plt.subplots(
        n, 1, figsize=(13, 1.0 + 0.42 * n_cells * n + 0.4 * n), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results, strict=True):
        _draw(ax, result, capacity_per_cell, horizon_s, unit, _time_unit(longest_s))
    axes[-1, 0].set_xlabel(f"time ({unit[2]})")
    handles = [
        Patch(color=_COLORS["load"], label="rollout load"),
        Patch(color=_COLORS["rollout"], label="rollout, free room"),
        Patch(color=_COLORS["to_train"], label="switching"),
        Patch(color=_COLORS["busy"], label="training"),
        Patch(color=_COLORS["train"], label="trainer waiting"),
        Line2D([], [], color="black", linewidth=0.8, alpha=0.5, label="optimizer update"),  # the thin lines
    ]
    fig.legend(
        handles=handles, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 1.0)
    )
    if title:
        fig.suptitle(title, y=1.0 - 0.5 / fig.get_figheight(), fontsize=10, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / fig.get_figheight()))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw(
    ax: Any,
    result: SimResult,
    capacity: float,
    horizon_s: float,
    unit: tuple[float, str, str, str],
    title_unit: tuple[float, str, str, str],
) -> None:
    tl = result.timeline
    h = 1 / unit[0]
    for cell, segments in enumerate(tl.segments):
        y = cell
        for start, end, kind in segments:
            end = result.makespan_s if end is None else end
            ax.barh(y, (end - start) * h, left=start * h, height=0.8, color=_COLORS[kind], linewidth=0)
        loads = tl.loads[cell]
        if tl.record and len(loads) > 1:
            xs = [t * h for t, _ in loads] + [result.makespan_s * h]
            ys = [y - 0.4 + 0.8 * min(1.0, load / capacity) for _, load in loads]
            ys.append(ys[-1])
            ax.fill_between(xs, y - 0.4, ys, step="post", color=_COLORS["load"], linewidth=0)
    for cell, start, end, _batch, _work in tl.micros:
        ax.barh(cell, (end - start) * h, left=start * h, height=0.8, color=_COLORS["busy"], linewidth=0)
    for t in tl.update_times:
        ax.axvline(t * h, color="black", linewidth=0.4, alpha=0.35)
    ax.set_yticks(range(len(tl.segments)))
    ax.set_yticklabels(["core" if i == 0 else f"cell {i}" for i in range(len(tl.segments))], fontsize=7)
    ax.set_ylim(-0.6, len(tl.segments) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, horizon_s * h)
    seconds, symbol, _, fmt = title_unit
    ax.set_title(
        f"{result.name}: {result.makespan_s / seconds:{fmt}} {symbol}, {result.utilization:.0%} utilised, "
        f"bound {result.lower_bound_s / seconds:{fmt}} {symbol}, mean staleness {result.mean_staleness:.2f}",
        fontsize=9,
        loc="left",
    )


_WASTE_PARTS = (  # (key in totals_cell_s, label, colour): the non-work parts of `gyre_ray.sim.waste`
    ("rollout_empty_s", "empty rollout room", _COLORS["rollout"]),
    ("train_other_s", "trainers waiting / syncing", _COLORS["train"]),
    ("switching_s", "switching", _COLORS["to_train"]),
)


def plot_waste(cases: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Where the time above the bound goes (`benchmarks/bench_sim_waste.py`'s cases, one panel per preset).

    Each bar is one cell count: the run's non-work as a share of cells x makespan, split into empty
    rollout room, other training-role time and switching; the black tick is the share the bound
    grants (what no schedule avoids); the label is the run's makespan over the bound.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    presets = list(dict.fromkeys(c["preset"] for c in cases))
    if not presets:
        raise ValueError("plot_waste: no cases to draw")
    most = max(len([c for c in cases if c["preset"] == p]) for p in presets)
    fig, axes = plt.subplots(
        1, len(presets), figsize=(4.2 * len(presets), 1.4 + 0.36 * most), sharex=True, squeeze=False
    )
    widest = 0.0
    for ax, preset in zip(axes[0], presets, strict=True):
        rows = sorted((c for c in cases if c["preset"] == preset), key=lambda c: c["cells"])
        for y, row in enumerate(rows):
            whole = row["cells"] * row["makespan_s"]
            left = 0.0
            for key, _, colour in _WASTE_PARTS:
                share = 100 * row["totals_cell_s"][key] / whole
                ax.barh(y, share, left=left, height=0.7, color=colour, edgecolor="#8a8a8a", linewidth=0.3)
                left += share
            granted = 100 * row["bound_grants_cell_s"] / whole
            ax.plot([granted, granted], [y - 0.42, y + 0.42], color="black", linewidth=1.4)
            ax.text(left + 0.3, y, f"{row['ratio_to_bound']:.3f}x", va="center", fontsize=7)
            widest = max(widest, left, granted)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{row['cells']} cells" for row in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(preset, fontsize=9, loc="left")
        ax.set_xlabel("% of cells x makespan", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    right = widest * 1.25 + 1
    axes[0, 0].set_xlim(-0.02 * right, right)  # room left of 0: a bound granting 0 is a tick, not the frame
    handles = [Patch(facecolor=colour, edgecolor="#8a8a8a", label=label) for _, label, colour in _WASTE_PARTS]
    handles.append(Line2D([], [], color="black", linewidth=1.4, label="granted by the bound"))
    fig.legend(handles=handles, loc="upper center", ncol=4, frameon=False, fontsize=8)
    if title:
        fig.suptitle(title, y=0.02, fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.05 if title else 0, 1, 1 - 0.25 / fig.get_figheight()))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
