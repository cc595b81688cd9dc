"""Metrics logging: every step's metrics go to `metrics.jsonl` in the run folder and to wandb.

wandb runs offline by default (no network needed; `wandb sync` uploads later); mode `disabled`
skips it. A wandb failure never stops training: it is reported once and logging continues to
the JSONL file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Append-only metrics for one run."""

    def __init__(
        self, run_dir: Path, run_name: str, config: dict[str, Any], wandb_mode: str = "offline"
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(
                    project="gyre-ray",
                    name=run_name,
                    dir=str(run_dir),
                    mode=wandb_mode,
                    config=config,
                    settings=wandb.Settings(silent=True, console="off"),
                )
            except Exception as exc:  # wandb is optional at run time
                print(
                    f"gyre-ray: wandb unavailable ({type(exc).__name__}: {exc}); logging to {self.path}",
                    file=sys.stderr,
                )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row, default=float) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
