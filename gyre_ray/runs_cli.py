"""`gyre-ray runs [ROOT]`: the run folders under ROOT (`run.run_dir`, default `runs`) at a glance.

One line per run folder, newest first: its status, the steps logged of those configured, the reward
(mean of the first 3 scored steps -> of the last 3, fewer in a run of under 6 so that the ends do
not overlap, as `gyre-ray train` prints it), the makespan, its newest complete checkpoint, and what
to do next where there is something to do. The status is read from what the job leaves:
- `running`: `driver.json` names a driver that still runs on this host (every run writes it while
  its driver runs, local or not);
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
A file whose JSON holds what the job never writes (a metrics row whose `reward_mean` is no finite
number, a summary whose `costs` is no object, ...) is read like a torn one: rows up to it count, its
summary is no proof the run ended, and its note joins the run's error; one such folder never hides
the others.
A `config.json` that does not read as the job writes it (not a JSON object, a `run.steps` that is no
step count) loses only the configured step count, with a note; a `summary.json` that is JSON but no
object is said so. A newest checkpoint whose state.json holds no step is noted and passed over for
the one before it (as `--resume` does), without changing the status. Warm-up caches (`warmup.json`)
and folders without `config.json` are not runs and are left out. ROOT that is itself a run folder is
refused with a hint to give its parent.
`--json` prints the same as one JSON list.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import complete_checkpoints, load_state
from gyre_ray.json_values import is_int, is_number, short
from gyre_ray.live_run import LIVE_FILE, driver_state, recorded_driver
from gyre_ray.observability.metrics import trend_window
from gyre_ray.proxy.store_files import json_lines, json_object
from gyre_ray.run_folder import is_run_folder
from gyre_ray.train import FAILED_FILE, NOTHING_SCORED

FIRST_LAST = 3  # steps averaged at each end of the reward


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs", help="list the run folders: status, steps, reward, what to do next"
    )
    parser.add_argument(
        "root",
        nargs="?",
        default="runs",
        help="the folder holding run folders (default: runs, the default run.run_dir)",
    )
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.set_defaults(handler=_runs_command)


def _runs_command(args: argparse.Namespace) -> int:
    from gyre_ray.config import ConfigError

    root = Path(args.root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder (give the folder that holds run folders: run.run_dir)")
    runs = list_runs(root)
    if not runs and is_run_folder(root):
        parent = root.resolve().parent
        raise ConfigError(
            f"{root} looks like a run folder (it holds config.json); give the folder that holds run "
            f"folders, its parent: gyre-ray runs {parent}"
        )
    if args.json:
        print(json.dumps(runs, indent=2))
    else:
        print(format_runs(runs, root))
    return 0


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Every run folder directly under `root`, newest first (by its config.json's time)."""
    # (a warm-up cache, or one being saved as warmup-<key>.tmp, holds an HF config.json: not a run)
    folders = [
        p for p in root.iterdir() if p.is_dir() and not (p / "warmup.json").exists() and is_run_folder(p)
    ]
    folders.sort(key=lambda p: (p / "config.json").stat().st_mtime, reverse=True)
    return [_describe_or_note(p) for p in folders]


def _describe_or_note(folder: Path) -> dict[str, Any]:
    """`describe_run`, or, where the folder cannot be read at all, a stopped run that says why: one bad
    folder must not hide the others."""
    try:
        return describe_run(folder)
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
        run = _blank_run(folder)
        run["error"] = f"the run folder could not be read: {type(exc).__name__}: {exc}"[:300]
        run["next"] = _next_step(run)
        return run


def _blank_run(folder: Path) -> dict[str, Any]:
    return {
        "folder": str(folder),
        "name": folder.name,
        "status": "stopped",
        "error": None,
        "steps_logged": 0,
        "steps_configured": None,
        "reward_first": None,
        "reward_last": None,
        "makespan_s": None,
        "checkpoint_step": None,
        "driver": None,
    }


_TORN = object()  # a file that is not JSON (empty, cut off, not text)


def _json_file(path: Path) -> Any:
    """The JSON value a file holds, or `_TORN` when it does not read as JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return _TORN


def _steps_configured(folder: Path, notes: list[str] | None = None) -> int | None:
    """`run.steps` of the run's config.json; None (with a note to `notes`) when it does not read."""
    notes = [] if notes is None else notes
    config = _json_file(folder / "config.json")
    if config is _TORN:
        notes.append("config.json does not read as JSON (empty or cut off): its step count is unknown")
        return None
    if not isinstance(config, dict):
        notes.append(f"config.json {short(config)} is not a JSON object: its step count is unknown")
        return None
    run = config.get("run", {})
    if not isinstance(run, dict):
        notes.append(f"config.json: run {short(run)} is not an object: its step count is unknown")
        return None
    steps = run.get("steps")
    if steps is not None and not (is_int(steps) and steps >= 0):
        notes.append(f"config.json: run.steps {short(steps)} is not a step count")
        return None
    return steps


def _rewards(path: Path, notes: list[str]) -> tuple[int, list[float]]:
    """Steps logged and their rewards, up to a torn line or a row the job never writes (noted)."""
    logged, rewards = 0, []
    try:
        for number, row in enumerate(json_lines(path), 1):
            if not isinstance(row, dict):
                notes.append(f"{path.name} line {number} is not a JSON object")
                break
            if "reward_mean" not in row:
                continue
            value = row["reward_mean"]
            # a step that scored no execution logs reward_mean null: logged, but no reward to average
            if value is not None and not is_number(value):
                notes.append(f"{path.name} line {number}: reward_mean {short(value)} is not a number")
                break
            logged += 1
            if value is not None:
                rewards.append(float(value))
    except (OSError, ValueError) as exc:  # not text (UnicodeDecodeError), not a file
        notes.append(f"{path.name} could not be read: {type(exc).__name__}")
    return logged, rewards


def _checkpoint_step(folder: Path, notes: list[str]) -> int | None:
    """The step of the newest complete checkpoint whose state.json holds one; each newer one whose
    state.json does not is noted and passed over, as `gyre-ray train --resume` passes over a damaged
    checkpoint for the one before it."""
    for checkpoint in reversed(complete_checkpoints(folder)):
        try:
            step = load_state(checkpoint).get("step")
        except (OSError, ValueError, AttributeError):
            step = None
        if is_int(step) and step >= 0:
            return step
        notes.append(f"{checkpoint.name}: its state.json holds no step number")
    return None


def describe_run(folder: Path) -> dict[str, Any]:
    """One run folder's status, progress, reward, makespan, newest checkpoint and next step."""
    notes: list[str] = []  # files holding what the job never writes: read like torn ones
    # an odd config.json (only its step count is lost) or checkpoint (an older one is resumed from)
    # says nothing of how the run ended: noted without changing its status
    side_notes: list[str] = []
    logged, rewards = _rewards(folder / "metrics.jsonl", notes)
    ends = trend_window(len(rewards), FIRST_LAST)  # steps averaged at each end, never overlapping
    run = _blank_run(folder)
    run.update(
        steps_logged=logged,
        steps_configured=_steps_configured(folder, side_notes),
        reward_first=_mean(rewards[:ends]),
        reward_last=_mean(rewards[-ends:]),
        checkpoint_step=_checkpoint_step(folder, side_notes),
    )
    summary, not_object = None, None
    if (folder / "summary.json").is_file():
        raw = _json_file(folder / "summary.json")
        summary = raw if isinstance(raw, dict) else {}  # {}: no proof the run ended
        if raw is not _TORN and not isinstance(raw, dict):
            not_object = f"summary.json {short(raw)} is not a JSON object (so no proof the run ended)"
    if summary:
        costs = summary.get("costs")
        makespan = costs.get("makespan_s") if isinstance(costs, dict) else None
        if costs is not None and not isinstance(costs, dict):
            notes.append(f"summary.json: costs {short(costs)} is not an object")
        elif makespan is not None and not is_number(makespan):
            notes.append(f"summary.json: costs.makespan_s {short(makespan)} is not a number")
        else:
            run["makespan_s"] = makespan
    errors = []
    # a driver that still runs on this host first (a resumed segment of a failed run has failed.json
    # until it ends well); then failed.json: a run that ended with no execution scored, or a resumed
    # segment that failed after an earlier one wrote summary.json, has both
    live = (folder / LIVE_FILE).is_file()  # (its own driver line says whether that driver runs)
    if not live and driver_state(recorded_driver(folder)) == "running":
        run["status"] = "running"
    elif (folder / FAILED_FILE).is_file():
        run["status"] = "failed"
        error = json_object(folder / FAILED_FILE, {}).get("error")
        if error is not None and not isinstance(error, str):
            notes.append(f"{FAILED_FILE}: error {short(error)} is not text")
        elif error:
            errors.append(error)
    elif live:
        run["status"] = "live"
        run["driver"] = driver_state(_driver(json_object(folder / LIVE_FILE, {}).get("driver"), notes))
    elif summary and not notes:
        run["status"] = "done"
    elif summary is not None and not summary:  # the job was killed while writing its last file
        errors.append(not_object or "summary.json is empty or cut off (the job was killed while writing it)")
    run["error"] = "; ".join(errors + notes + side_notes) or None
    run["next"] = _next_step(run)
    return run


def _driver(driver: Any, notes: list[str]) -> Any:
    """live-run.json's driver as `driver_state` reads it: a pid that is no number is noted, not looked up."""
    if isinstance(driver, dict) and "pid" in driver and not is_int(driver["pid"]):
        notes.append(f"{LIVE_FILE}: driver pid {short(driver['pid'])} is not a number")
        return None
    return driver


def _next_step(run: dict[str, Any]) -> str:
    folder = run["folder"]
    if run["status"] == "running":
        return "its driver still runs on this host: wait for it (or stop it, then resume)"
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
    width = max(34, *(len(run["name"]) for run in runs))  # a long run.name must not shift the columns
    lines = [
        f"{'run':{width}s} {'status':8s} {'steps':>7s} {'reward first -> last':>21s} {'makespan':>9s} {'ckpt':>5s}"
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
            f"{run['name']:{width}s} {run['status']:8s} {steps:>7s} {reward:>21s} {makespan:>9s} {ckpt:>5s}"
        )
        if run["error"]:
            notes.append(f"  {run['name']}: {run['error']}")
        if run["next"] and run["status"] != "done":
            notes.append(f"  {run['name']}: {run['next']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
