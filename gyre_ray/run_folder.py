"""What a run folder is: the files the job writes at its top, and the one test that every command
uses to recognise a run folder given where it wants something else (an HF model folder, the folder
that holds runs, a folder of call records), so that they all agree and can say what to give instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import CHECKPOINTS
from gyre_ray.proxy.store_files import json_object

CONFIG_FILE = "config.json"
# what the job writes at a run folder's top, beside config.json (`gyre-ray eval --out` writes eval.jsonl)
JOB_FILES = (
    "metrics.jsonl",
    "trace.jsonl",
    "costs.json",
    "summary.json",
    "eval.jsonl",
    "failed.json",
    "live-run.json",
)
# keys of an HF model's config.json, which a run's never has
_HF_CONFIG_KEYS = ("vocab_size", "model_type")


def job_files(folder: Path) -> list[str]:
    """The files of the job that `folder` holds at its top, config.json first (empty: none)."""
    return [name for name in (CONFIG_FILE, *JOB_FILES) if (folder / name).is_file()]


def is_run_folder(folder: Path) -> bool:
    """True when `folder` is a run folder: a config.json that is no HF model's, beside a checkpoints/
    folder or a file only the job writes, or (a run that logged nothing yet) one with a `run` section.
    A config.json that does not read (cut off) counts when the job's files are there."""
    if not (folder / CONFIG_FILE).is_file():
        return False
    config = json_object(folder / CONFIG_FILE)
    if config is not None and any(key in config for key in _HF_CONFIG_KEYS):
        return False
    if (folder / CHECKPOINTS).is_dir() or any((folder / name).is_file() for name in JOB_FILES):
        return True
    return config is not None and isinstance(config.get("run"), dict)


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, then renamed over it): a
    job killed mid-write (`ray job stop`'s SIGKILL follows its SIGTERM after 3 s) leaves the old file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def replace_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """`replace_text` of one JSON object per line."""
    replace_text(path, "".join(json.dumps(row) + "\n" for row in rows))
