"""Cell-role timelines: one panel per policy, one row per cell, the saw-tooth of rollout load.

Each row shows what the cell is doing: rolling out (blue, filled to its load, so draining
executions make the saw-tooth), switching (grey), training micro-steps (orange; pale orange is a
trainer waiting for work). Vertical ticks mark optimizer updates. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre_ray.sim.timeline import SimResult

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
    """Draw every result's cell-role timeline into one PNG at `path` (hours on the x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    n_cells = max(r.n_cells for r in results)
    horizon = max_hours or max(r.makespan_s for r in results) / 3600.0
    fig, axes = plt.subplots(
        n, 1, figsize=(13, 1.0 + 0.42 * n_cells * n + 0.4 * n), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results, strict=True):
        _draw(ax, result, capacity_per_cell, horizon)
    axes[-1, 0].set_xlabel("time (hours)")
    handles = [
        Patch(color=_COLORS["load"], label="rollout load"),
        Patch(color=_COLORS["rollout"], label="rollout, free room"),
        Patch(color=_COLORS["to_train"], label="switching"),
        Patch(color=_COLORS["busy"], label="training"),
        Patch(color=_COLORS["train"], label="trainer waiting"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=5, frameon=False, bbox_to_anchor=(0.5, 1.0))
    if title:
        fig.suptitle(title, y=1.0 - 0.5 / fig.get_figheight(), fontsize=10, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / fig.get_figheight()))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw(ax: Any, result: SimResult, capacity: float, horizon: float) -> None:
    tl = result.timeline
    h = 1 / 3600.0
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
    ax.set_xlim(0, horizon)
    ax.set_title(
        f"{result.name}: {result.makespan_s / 3600:.1f} h, {result.utilization:.0%} utilised, "
        f"bound {result.lower_bound_s / 3600:.1f} h, mean staleness {result.mean_staleness:.2f}",
        fontsize=9,
        loc="left",
    )
