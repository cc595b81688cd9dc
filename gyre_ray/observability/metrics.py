"""Metrics logging: every step's metrics go to `metrics.jsonl` in the run folder and to wandb.

wandb runs offline by default (no network needed; `wandb sync RUN_DIR/wandb/offline-run-*` uploads
later; `run.wandb_mode=online` logs live, after `wandb login`); mode `disabled` skips it. What wandb
gets: every step metric (nested figures flattened, `staleness/max`, `trained_by_cell/cell-0`, ...),
each evaluation round as `eval/...` scalars against its own axis `eval/step`, and at the end of the
run the switch events as a table (`switch_events`) and the report's pictures as images
(`report/<name>`). A resumed run logs into the same wandb run id (saved as `wandb-id.txt`), and first
sends the rows the resume put back into metrics.jsonl (steps published but never logged before the
driver stopped; `gyre_ray.resume` leaves them in `wandb-pending.jsonl`). A wandb failure never
stops training: it is reported once and logging continues to the JSONL file.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

from gyre_ray.json_values import is_int
from gyre_ray.run_folder import replace_text

SWITCH_COLUMNS = (
    "cell", "direction", "at_s", "seconds", "batch", "executions_running", "executions_rehosted",
    "requests_migrated", "drain_s", "demand", "rollout_capacity",
)  # fmt: skip
WANDB_ID_FILE = "wandb-id.txt"
WANDB_PENDING_FILE = "wandb-pending.jsonl"  # metrics rows a resume recovered, not yet sent to wandb


def trend_window(scored_steps: int, window: int = 3) -> int:
    """Steps averaged at each end of a reward trend: up to `window`, never overlapping (one step: itself)."""
    return max(1, min(window, scored_steps // 2))


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in `metrics`, nested dicts as `outer/inner` keys (lists and text are left out)."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
        elif isinstance(value, bool):
            flat[name] = int(value)
    return flat


class MetricsLogger:
    """Append-only metrics for one run."""

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        config: dict[str, Any],
        wandb_mode: str = "offline",
        resume: bool = False,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.last_step = 0
        # what goes to wandb before this segment's first row (an evaluation round that ends first, the
        # end-of-run table) goes to the step after the rows a resumed run logged before: wandb drops
        # anything logged at a step below one it has (online, a resumed run starts after its last step)
        self._logged = False
        self._resume_step = self._next_step() if resume else 0
        self._wandb = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(
                    project="gyre-ray",
                    name=run_name,
                    id=_wandb_id(run_dir),
                    resume="allow" if resume else None,
                    dir=str(run_dir),
                    mode=wandb_mode,
                    config=config,
                    settings=wandb.Settings(silent=True, console="off"),
                )
                self._wandb.define_metric("eval/step")
                self._wandb.define_metric("eval/*", step_metric="eval/step")
            except Exception as exc:  # wandb is optional at run time
                self._wandb_failed(exc)
        self._send_pending(run_dir / WANDB_PENDING_FILE)

    def _next_step(self) -> int:
        """The step after the last row of metrics.jsonl (0 without one, or when it does not read)."""
        from gyre_ray.proxy.store_files import json_lines

        try:
            rows = list(json_lines(self.path))
        except (OSError, ValueError):
            return 0
        steps = [row["step"] for row in rows if isinstance(row, dict) and is_int(row.get("step"))]
        return max(steps) + 1 if steps else 0

    def _extra_step(self) -> int:
        """The wandb step for what is no step's row: the last row's step, or, before this segment logged
        one, the step it resumes at."""
        return self.last_step if self._logged else self._resume_step

    def _send_pending(self, path: Path) -> None:
        """Rows a resume recovered (already in metrics.jsonl) to wandb, in step order; then forget them."""
        from gyre_ray.proxy.store_files import json_lines

        if not path.is_file():
            return
        rows = [row for row in json_lines(path) if isinstance(row.get("step"), int)]
        for row in sorted(rows, key=lambda r: r["step"]):
            self.last_step, self._logged = max(self.last_step, row["step"]), True
            self._send(flatten({k: v for k, v in row.items() if k != "step"}), row["step"])
        path.unlink()

    def _wandb_failed(self, exc: Exception) -> None:
        print(
            f"gyre-ray: wandb unavailable ({type(exc).__name__}: {exc}); logging to {self.path}",
            file=sys.stderr,
        )
        self._wandb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row, default=float) + "\n")
        self.last_step, self._logged = max(self.last_step, step), True
        self._send(flatten({k: v for k, v in metrics.items() if k != "step"}), step)

    def log_eval(self, row: dict[str, Any]) -> None:
        """One evaluation round (already in eval.jsonl) to wandb, on the `eval/step` axis."""
        from gyre_ray.evaluation import flat_metrics

        self._send(flat_metrics(row), self._extra_step())

    def finish_run(self, summary: dict[str, Any], report: Path | None) -> None:
        """The end of the run for wandb: the switch events as a table, the report's pictures as images."""
        if self._wandb is None:
            return
        try:
            import wandb

            rows = [[e.get(c) for c in SWITCH_COLUMNS] for e in summary.get("switches", [])]
            data: dict[str, Any] = {"switch_events": wandb.Table(columns=list(SWITCH_COLUMNS), data=rows)}
            if report is not None:
                for picture in sorted(report.parent.glob("*.png")):
                    data[f"report/{picture.stem}"] = wandb.Image(str(picture), caption=picture.stem)
            self._wandb.log(data, step=self._extra_step())
        except Exception as exc:
            self._wandb_failed(exc)

    def _send(self, data: dict[str, Any], step: int) -> None:
        if self._wandb is None:
            return
        try:
            self._wandb.log(data, step=step)
        except Exception as exc:
            self._wandb_failed(exc)

    def close(self) -> None:
        """Finish the wandb run (a failure to, e.g. an upload that fails online, is reported, not raised:
        it would hide the run's result or its own error)."""
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:
                self._wandb_failed(exc)
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """The run folder's wandb run id (made once, reused when the run is resumed)."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and (known := path.read_text().strip()):  # (an empty one: made again)
        return known
    run_id = secrets.token_hex(4)
    replace_text(path, run_id + "\n")
    return run_id
