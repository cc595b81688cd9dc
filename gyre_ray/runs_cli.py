"""`gyre-ray runs [ROOT]`: the run folders under ROOT (`run.run_dir`, default `runs`) at a glance.

One line per run folder, newest first: its status, the steps logged of those configured, the reward
(mean of the first 3 steps -> of the last 3), the makespan, its newest complete checkpoint, and what
to do next where there is something to do. The status is read from what the job leaves:
- `done`: `summary.json` (the job's last write; an empty or torn one, the job killed while writing
  it, does not count: such a run is `stopped` unless failed.json or live-run.json say more);
- `failed`: `failed.json` (an error, Ctrl-C, or no execution scored in any step:
  `gyre_ray.train.note_failure`), with its error; it wins over `summary.json` (a resumed segment
  that failed after an earlier one ended);
- `live`: `live-run.json` (a run on a persistent Ray cluster whose driver is or was attached to it:
  `gyre-ray train --attach` finishes it if that driver died), with `driver` from
  `gyre_ray.live_run.driver_state`: `running`, `gone` (a driver of this host no longer runs: attach,
  or resume if the cluster went too) or `elsewhere`;
- `stopped`: none of these (the driver was killed outright, or the machine went down).
Warm-up caches (`warmup.json`) and folders without `config.json` are not runs and are left out.
`--json` prints the same as one JSON list.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import complete_checkpoints, load_state
from gyre_ray.live_run import LIVE_FILE, driver_state
from gyre_ray.proxy.store_files import json_lines, json_object
from gyre_ray.train import FAILED_FILE, NOTHING_SCORED

FIRST_LAST = 3  # steps averaged at each end of the reward


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs", help="list the run folders: status, steps, reward, what to do next"
    )
    parser.add_argument(
        "root", nargs="?", default="runs", help="the folder holding run folders (run.run_dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.set_defaults(handler=_runs_command)


def _runs_command(args: argparse.Namespace) -> int:
    from gyre_ray.config import ConfigError

    root = Path(args.root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder (give the folder that holds run folders: run.run_dir)")
    runs = list_runs(root)
    if args.json:
        print(json.dumps(runs, indent=2))
    else:
        print(format_runs(runs, root))
    return 0


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Every run folder directly under `root`, newest first (by its config.json's time)."""
    folders = [
        p
        for p in root.iterdir()
        if p.is_dir() and (p / "config.json").is_file() and not (p / "warmup.json").exists()
    ]
    folders.sort(key=lambda p: (p / "config.json").stat().st_mtime, reverse=True)
    return [describe_run(p) for p in folders]


def describe_run(folder: Path) -> dict[str, Any]:
    """One run folder's status, progress, reward, makespan, newest checkpoint and next step."""
    try:
        steps_configured = int(json.loads((folder / "config.json").read_text())["run"]["steps"])
    except (ValueError, KeyError, TypeError):
        steps_configured = None
    logged = [row for row in json_lines(folder / "metrics.jsonl") if "reward_mean" in row]
    # a step that scored no execution logs reward_mean null: logged, but no reward to average
    rewards = [float(row["reward_mean"]) for row in logged if row["reward_mean"] is not None]
    run: dict[str, Any] = {
        "folder": str(folder),
        "name": folder.name,
        "status": "stopped",
        "error": None,
        "steps_logged": len(logged),
        "steps_configured": steps_configured,
        "reward_first": _mean(rewards[:FIRST_LAST]),
        "reward_last": _mean(rewards[-FIRST_LAST:]),
        "makespan_s": None,
        "checkpoint_step": None,
        "driver": None,
    }
    checkpoints = complete_checkpoints(folder)
    if checkpoints:
        run["checkpoint_step"] = int(load_state(checkpoints[-1]).get("step", 0))
    summary = json_object(folder / "summary.json", {}) if (folder / "summary.json").is_file() else None
    if summary:
        run["makespan_s"] = (summary.get("costs") or {}).get("makespan_s")
    # failed.json first: a run that ended with no execution scored, or a resumed segment that failed
    # after an earlier one wrote summary.json, has both
    if (folder / FAILED_FILE).is_file():
        run["status"] = "failed"
        run["error"] = json_object(folder / FAILED_FILE, {}).get("error")
    elif (folder / LIVE_FILE).is_file():
        run["status"] = "live"
        run["driver"] = driver_state(json_object(folder / LIVE_FILE, {}).get("driver"))
    elif summary:
        run["status"] = "done"
    elif summary is not None:  # the job was killed while writing its last file: the run did not end
        run["error"] = "summary.json is empty or cut off (the job was killed while writing it)"
    run["next"] = _next_step(run)
    return run


def _next_step(run: dict[str, Any]) -> str:
    folder = run["folder"]
    if run["status"] == "live":
        if run["driver"] == "running":
            return "its driver still runs on this host: wait for it (or stop it, then --attach)"
        attach = f"gyre-ray train --attach {folder}"
        resume = f"gyre-ray train --resume {folder}"
        if run["driver"] == "gone":
            return f"its driver is gone: {attach} finishes it (if the Ray cluster is gone too: {resume})"
        return f"{attach} (if its driver died)"
    if run["status"] == "done":
        more = run["checkpoint_step"] is not None
        return f"gyre-ray train --resume {folder} run.steps=N (more steps)" if more else ""
    if run["status"] == "failed" and NOTHING_SCORED in (run["error"] or ""):
        return "fix the harness (agents.*; the executions' logs are under workspaces/), then start a new run"
    if run["checkpoint_step"] is not None:
        return f"gyre-ray train --resume {folder}"
    return "no checkpoint to resume from: start again (run.checkpoint_every=N saves one every N steps)"


def format_runs(runs: list[dict[str, Any]], root: Path) -> str:
    """The list as a table (newest first), then each run's error and next step where there is one."""
    if not runs:
        return f"no run folders under {root}"
    lines = [
        f"{'run':34s} {'status':8s} {'steps':>7s} {'reward first -> last':>21s} {'makespan':>9s} {'ckpt':>5s}"
    ]
    notes = []
    for run in runs:
        steps = (
            f"{run['steps_logged']}/{run['steps_configured'] if run['steps_configured'] is not None else '?'}"
        )
        reward = (
            f"{run['reward_first']:.3f} -> {run['reward_last']:.3f}"
            if run["reward_first"] is not None
            else "-"
        )
        makespan = f"{run['makespan_s']:.1f} s" if run["makespan_s"] is not None else "-"
        ckpt = str(run["checkpoint_step"]) if run["checkpoint_step"] is not None else "-"
        lines.append(
            f"{run['name']:34s} {run['status']:8s} {steps:>7s} {reward:>21s} {makespan:>9s} {ckpt:>5s}"
        )
        if run["error"]:
            notes.append(f"  {run['name']}: {run['error']}")
        if run["next"] and run["status"] != "done":
            notes.append(f"  {run['name']}: {run['next']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
