"""The core cell dies: the driver restarts the run from its newest checkpoint, by itself.

The core holds the only copy of the optimizer state, so the scheduler cannot replace it the way it
replaces other cells (`gyre_ray.runtime.recovery`): its run ends with `CoreLostError`. The driver
(`gyre_ray.train.train`) then shuts the runtime down, starts a fresh one and resumes the same run
folder from its newest complete checkpoint, the code path of `gyre-ray train --resume RUN_DIR`
(`gyre_ray.resume`), at most `run.max_core_restarts` times in a run. With no checkpoint yet the run
starts again from step 0 in the same folder. Work lost: the updates done after that checkpoint (none
with `run.checkpoint_every=1`, the step being checkpointed right as it is published) and the step in
progress. Every restart is a row of the summary's `core_restarts`. Before the runtime goes, the dead
segment's execution rows are written to `trace.jsonl` (`keep_trace`), so the finished run's trace
holds the steps before the checkpoint too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import latest_good, load_state


class CoreLost(Exception):
    """The core cell died during a segment of the run (`why`; `updates_done`: steps finished by then)."""

    def __init__(self, why: str, updates_done: int) -> None:
        super().__init__(why)
        self.why = why
        self.updates_done = updates_done


def core_loss(runtime: Any, exc: BaseException) -> str | None:
    """Why the core is gone, if `exc` (raised while driving the run) comes from its death; else None.

    The scheduler's `CoreLostError` says so; any other failure counts when the core no longer answers
    (e.g. it died during a checkpoint the scheduler was writing)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from gyre_ray.runtime.recovery import CoreLostError

    if isinstance(exc, CoreLostError) or isinstance(getattr(exc, "cause", None), CoreLostError):
        text = str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1]
        return text.split(";")[0]  # "the core cell cell-0 died (ActorDiedError)"
    try:
        ray.get(runtime.core.trainer_version.remote(), timeout=30)
    except (RayActorError, GetTimeoutError) as gone:
        return f"the core cell {runtime.core_id} no longer answers ({type(gone).__name__})"
    return None


def updates_done(runtime: Any, fallback: int) -> int:
    """The steps the scheduler had finished (its progress counter), or `fallback` if it cannot say."""
    import ray

    try:
        snapshot = ray.get(runtime.scheduler.progress.remote(), timeout=30)
    except Exception:
        return fallback
    return int(snapshot.get("updates", fallback)) if snapshot.get("started") else fallback


def plan_restart(
    run_dir: Path, lost: CoreLost, attempt: int, warn: Callable[[str], Any] | None = None
) -> tuple[dict[str, Any], Path | None]:
    """Where restart `attempt` resumes (the newest checkpoint whose files read: a damaged newer one is
    skipped, with a line to `warn`, as `--resume` does; None: the start of the run) and its summary row."""
    checkpoint = latest_good(run_dir, warn)
    return restart_row(checkpoint, lost, attempt), checkpoint


def restart_row(checkpoint: Path | None, lost: CoreLost, attempt: int) -> dict[str, Any]:
    """The summary row of one restart resuming from `checkpoint`: how many finished steps it loses."""
    step = int(load_state(checkpoint)["step"]) if checkpoint is not None else 0
    return {
        "restart": attempt,
        "why": lost.why,
        "updates_done": lost.updates_done,
        "resumed_from_step": step,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "steps_lost": max(0, lost.updates_done - step),
    }


def describe(row: dict[str, Any], limit: int) -> str:
    """The progress line of a restart."""
    where = (
        f"from checkpoint {row['checkpoint']} (step {row['resumed_from_step']})"
        if row["checkpoint"]
        else "from the start of the run (no checkpoint yet)"
    )
    return f"gyre-ray: {row['why']} after {row['updates_done']} step(s); restarting the run {where}, {row['steps_lost']} finished step(s) lost; restart {row['restart']} of {limit}"


def keep_trace(runtime: Any, run_dir: Path, first_step: int, offset: float) -> None:
    """Write the dying segment's trace rows (times moved by `offset`) to `run_dir/trace.jsonl` after an
    earlier segment's rows of steps < `first_step`; nothing when the scheduler actor cannot say (it
    died too). The resumed segment keeps the rows of the steps before its checkpoint
    (`gyre_ray.resume.merge_segments`)."""
    import ray

    from gyre_ray.resume import merged_trace
    from gyre_ray.runtime.report import write_trace

    try:
        rows = ray.get(runtime.scheduler.trace_rows.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - the trace is a record of the run, never a reason to stop it
        return
    write_trace(run_dir, merged_trace(run_dir, first_step, offset, rows))
