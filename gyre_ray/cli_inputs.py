"""What several commands check on their command line the same way: where a setting is given (an
override or the `--config` file), a `model.path` given beside `--run` / `--model-dir`, and a run folder
given where an HF model folder is wanted (`eval`, `generate`, `logprobs`)."""

from __future__ import annotations

import sys
from pathlib import Path

from gyre_ray.run_folder import is_run_folder


def warn_on_stderr(line: str) -> None:
    """A warning line for stderr (stdout may carry `--json -`)."""
    print(line, file=sys.stderr, flush=True)


def given_setting(
    section: str, key: str, overrides: list[str], config_file: str | Path | None = None
) -> str | None:
    """Where the command line itself sets `section.key`: the first override that does (`section.key=X`
    or `section={key: X}`), quoted, else `section.key in FILE` when the `--config` file sets it (to
    anything but null, even its default); None when neither does. A command whose --run / --model-dir
    names the model refuses a `model.path` given so rather than drop one of the two."""
    from gyre_ray.config import parse_override, read_config_file

    for text in overrides:
        parts, value = parse_override(text)
        if parts == [section, key] or (parts == [section] and isinstance(value, dict) and key in value):
            return repr(text)
    table = read_config_file(config_file).get(section) if config_file is not None else None
    if isinstance(table, dict) and table.get(key) is not None:
        return f"{section}.{key} in {config_file}"
    return None


def refuse_model_path_clash(given: str, overrides: list[str], config_file: str | Path | None) -> None:
    """ConfigError when `model.path` is set on the command line beside `given` (the `--run` or
    `--model-dir` that names the model): one of the two would be dropped silently."""
    from gyre_ray.config import ConfigError

    if clash := given_setting("model", "path", overrides, config_file):
        raise ConfigError(f"{given} names the model; drop {clash} (give one of them, not both)")


def run_folder_hint(folder: Path, offer_run: bool = True) -> str | None:
    """When `folder` is a run folder given for an HF model folder (its config.json is the run's
    config): a message starting with the folder, saying what to give instead (`offer_run`: the
    command takes `--run` too); else None."""
    from gyre_ray.checkpoint import CHECKPOINTS, TRAINER_DIR, latest, trainer_dir

    if not is_run_folder(folder):
        return None
    newest = latest(folder)
    if newest is None:
        return (
            f"{folder} is a run folder, not an HF model folder, and holds no complete checkpoint yet "
            f"(a checkpoint's model folder is {folder / CHECKPOINTS}/step-N/{TRAINER_DIR})"
        )
    if not offer_run:
        return (
            f"{folder} is a run folder, not an HF model folder: give a checkpoint's model folder "
            f"(e.g. {trainer_dir(newest)})"
        )
    return (
        f"{folder} is a run folder, not an HF model folder: give --run {folder} (its newest checkpoint) "
        f"or a checkpoint's model folder, e.g. {trainer_dir(newest)}"
    )
