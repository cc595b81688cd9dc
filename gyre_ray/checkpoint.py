"""Run checkpoints: what a run needs to continue after it stopped (or died), written atomically.

    path = save(run_dir, step, write_trainer, state)   # <run_dir>/checkpoints/step-000004
    path = latest(run_dir)                               # the newest complete one, or None
    path = latest_good(run_dir, warn=print)              # the newest whose files read (resume uses it)
    state = load_state(path)                             # {"step": 4, "version": 4, ...}
    trainer_dir(path)                                    # HF folder + trainer_state.pt (optimizer, RNG)

A checkpoint is the folder `step-<N>` (N = updates done = the next step to run) holding `trainer/`
(the core's `Trainer.save`: HF weights, optimizer state, optimizer step, policy version, RNG states)
and `state.json` (the run's counters: step, version, the seed, the task cursor, and free-form extras
the caller adds). It is built in a hidden `.step-<N>.partial-*` folder, `state.json` last, and
renamed into place only when complete, so `latest` never sees half a checkpoint; partial folders
left by a crash are ignored (and removed by the next `save`). `save` keeps the newest `keep` ones.
A complete checkpoint can still be damaged afterwards (a file deleted or cut short): `problem` reads
its files' headers (no tensor is loaded) and `latest_good` / `require_good` skip one that does not
read, saying why, so a resume starts from the newest checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
TRAINER_DIR = "trainer"
_NAME = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for (the message says where and why)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def trainer_dir(checkpoint: str | Path) -> Path:
    """The trainer's folder inside a checkpoint (an HF model folder `model.path` can point at)."""
    return Path(checkpoint) / TRAINER_DIR


def save(
    run_dir: str | Path,
    step: int,
    write_trainer: Callable[[Path], Any],
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` of the run atomically; returns its folder.

    `write_trainer(folder)` writes the trainer's state into `folder` (e.g. the core's `save`);
    `state` is saved as `state.json` with `step` set. Older checkpoints beyond the newest `keep`
    (0 = keep all) and stale partial folders are removed afterwards.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    partial = root / f".{final.name}.partial-{secrets.token_hex(4)}"
    partial.mkdir()
    try:
        write_trainer(partial / TRAINER_DIR)
        if not (partial / TRAINER_DIR).is_dir():
            raise CheckpointError(f"the trainer wrote nothing into {partial / TRAINER_DIR}")
        text = json.dumps({**state, "step": step}, indent=2, default=float)
        tmp = partial / f"{STATE_FILE}.tmp"
        tmp.write_text(text)
        os.replace(tmp, partial / STATE_FILE)
        if final.exists():  # the same step written again (a resumed run): the new one wins
            shutil.rmtree(final)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _prune(root, keep, final)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every complete checkpoint of the run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file() and (p / TRAINER_DIR).is_dir()
    ]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None when it has none."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def require_latest(run_dir: str | Path) -> Path:
    """`latest`, or a CheckpointError saying why there is nothing to resume from."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a folder")
    path = latest(run_dir)
    if path is None:
        raise CheckpointError(
            f"{run_dir} holds no complete checkpoint under {CHECKPOINTS}/ "
            "(run.checkpoint_every > 0 writes one every N steps and at the end)"
        )
    return path


def problem(checkpoint: str | Path) -> str | None:
    """What makes a complete checkpoint unloadable, in a few words, or None when its files read: its
    state.json parses with a `step` that is a JSON integer >= 0 (not a string, not a bool); `trainer/`
    holds a parseable model config.json, model.safetensors (or an index and its shards) whose headers
    read and cover the file, and a non-empty, whole trainer_state*.pt (a torch zip archive). Reads
    headers only, no tensors (no Ray)."""
    from gyre_ray.json_values import is_int

    checkpoint = Path(checkpoint)
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        if not isinstance(state, dict) or "step" not in state:
            return f"{STATE_FILE} holds no step number"
        step = state["step"]
        if not is_int(step) or step < 0:
            raise ValueError(f"its step is {json.dumps(step)}, not a JSON integer >= 0")
    except FileNotFoundError:
        return f"no {STATE_FILE}"
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"{STATE_FILE} does not read ({type(exc).__name__}: {exc})"
    folder = checkpoint / TRAINER_DIR
    try:
        from gyre_ray.model.checkpoint import check_hf_folder

        check_hf_folder(folder)
    except (OSError, ValueError) as exc:
        return str(exc)
    states = sorted(folder.glob("trainer_state*.pt"))
    if not states:
        return f"no trainer_state.pt (optimizer state) in {folder}"
    for path in states:
        if path.stat().st_size == 0:
            return f"{path} is empty"
        if not zipfile.is_zipfile(path):
            return f"{path} is not a whole torch file (cut short?)"
    return None


def latest_good(run_dir: str | Path, warn: Callable[[str], Any] | None = None) -> Path | None:
    """The newest complete checkpoint whose files read (`problem`), or None; each newer damaged one is
    skipped, with a line to `warn` naming it and what is wrong."""
    for path in reversed(complete_checkpoints(run_dir)):
        why = problem(path)
        if why is None:
            return path
        if warn is not None:
            warn(f"gyre-ray: warning: skipping damaged checkpoint {path}: {why}")
    return None


def require_good(run_dir: str | Path, warn: Callable[[str], Any] | None = None) -> Path:
    """`latest_good`, or a CheckpointError saying why there is nothing to resume from."""
    newest = require_latest(run_dir)
    path = latest_good(run_dir, warn)
    if path is None:
        raise CheckpointError(
            f"no checkpoint of {run_dir} loads (the newest, {newest.name}: {problem(newest)})"
        )
    return path


def load_state(checkpoint: str | Path) -> dict[str, Any]:
    """The run counters a checkpoint saved (`state.json`)."""
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: no {STATE_FILE}")
    return json.loads(path.read_text())


def newest_good(run_dir: str | Path, warn: Callable[[str], Any] | None = None) -> tuple[Path, int]:
    """The run's newest checkpoint whose files read, and its step, as `train --resume` picks it
    (`require_good`: a newer damaged one is skipped with a line to `warn`); CheckpointError when none
    loads (`eval --run`, `generate --run`)."""
    from gyre_ray.json_values import is_int

    saved = require_good(run_dir, warn)
    try:
        step = load_state(saved).get("step")
    except (OSError, ValueError, AttributeError) as exc:  # changed since require_good read it
        raise CheckpointError(f"{saved}: its state.json does not read ({type(exc).__name__})") from None
    if not is_int(step) or step < 0:
        raise CheckpointError(f"{saved}: its state.json step {json.dumps(step)} is not a step number")
    return saved, step


def _prune(root: Path, keep: int, saved: Path) -> None:
    """Remove crashed saves, and all but the newest `keep` checkpoints up to `saved` (the one just
    written). Checkpoints past it (of a step beyond the one a resume started from: damaged, or a
    dead segment's) neither count toward `keep` nor go: counted, the one just written could be the
    one pruned, leaving nothing good to resume from."""
    for stale in root.glob(".step-*.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a crashed save: never complete, never resumed from
    if keep <= 0:
        return
    complete = complete_checkpoints(root.parent)
    upto = complete[: complete.index(saved) + 1] if saved in complete else complete
    for old in upto[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
