"""What a resume checks before Ray starts, and how it keeps each segment's config.

A resume continues the checkpoint's weights and optimizer state and the task plan of the run's
steps, so the settings those depend on may not change (`FIXED_ON_RESUME`, `check_resume_settings`),
and the model the config builds must have the checkpoint's architecture (`check_checkpoint_model`).
`keep_config` writes config.json once the restore succeeded, keeping an earlier segment's different
config as config.segment-<k>.json. See docs/checkpoints.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre_ray.checkpoint import trainer_dir
from gyre_ray.config import GyreConfig
from gyre_ray.proxy.store_files import json_object
from gyre_ray.run_folder import replace_text

# What a resume may not change: the weights and optimizer state are the checkpoint's (architecture,
# dtype), and step S's tasks are `plan_step`'s pick from S x run.tasks_per_step of agents.task_set.
# Everything else may change on resume (run.steps, cells.*, run.seed with a warning, ...).
FIXED_ON_RESUME = (
    "model.path",
    "model.preset",
    "model.dtype",
    "trainer.backend",  # the optimizer state's files differ: trainer_state.pt, trainer_state_tp{r}.pt
    "trainer.tensor_parallel_size",  # one optimizer-state file per tensor-parallel rank's shard
    "agents.task_set",
    "run.tasks_per_step",
    "run.eval_task_set",  # unset, the last run.eval_holdout tasks are held out of training:
    "run.eval_holdout",  # changing either would train on tasks evaluated so far (or drop some)
)


def _dotted(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


_MISSING = object()


def check_resume_settings(cfg: GyreConfig, run_dir: str | Path) -> None:
    """A ConfigError naming the setting, the run's value and the new one when `cfg` changes one a
    resume cannot take (`FIXED_ON_RESUME`) from the run folder's config.json; before Ray starts."""
    from gyre_ray.config import ConfigError

    path = Path(run_dir) / "config.json"
    saved = json_object(path)
    if saved is None:
        return  # resume_config says what is wrong with the folder
    new = json.loads(cfg.model_dump_json())
    for key in FIXED_ON_RESUME:
        old, now = _dotted(saved, key), _dotted(new, key)
        if old is _MISSING or now is _MISSING or old == now:
            continue
        if key == "model.path" and old and now and Path(old).resolve() == Path(now).resolve():
            continue  # the same folder, spelt otherwise
        raise ConfigError(
            f"{key} cannot change on resume: {run_dir} ran with {key}={old}, given {key}={now} "
            "(start a new run for another one)"
        )


ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings",
)  # fmt: skip


def check_checkpoint_model(cfg: GyreConfig, checkpoint: Path) -> None:
    """A ConfigError before Ray starts when the model `cfg` builds (model.path, or the preset) has
    another architecture than the checkpoint's weights (its trainer/config.json)."""
    from gyre_ray.config import ConfigError
    from gyre_ray.live_run import persistent_cluster
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.checkpoint import read_hf_config

    path = cfg.model.path
    if path and not Path(path).exists() and persistent_cluster():
        return  # a path only the workers see (check_model_path)
    try:
        saved = read_hf_config(trainer_dir(checkpoint))
        model = read_hf_config(path) if path else ModelArgs.preset(cfg.model.preset)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot resume: {exc}") from None
    wrong = [
        f"{k} {getattr(saved, k)} -> {getattr(model, k)}"
        for k in ARCH_KEYS
        if getattr(saved, k) != getattr(model, k)
    ]
    if wrong:
        where = f"model.path={path}" if path else f"model.preset={cfg.model.preset}"
        raise ConfigError(
            f"cannot resume: {where} is another architecture than checkpoint {checkpoint.name} "
            f"({', '.join(wrong)})"
        )


def keep_config(run_dir: Path, text: str) -> None:
    """Write `text` as the run's config.json; an earlier segment's different config is kept as
    config.segment-<k>.json (k = 1, 2, ... in order)."""
    path = run_dir / "config.json"
    old = path.read_text() if path.is_file() else None
    if old == text:
        return
    if old:
        k = 1 + sum(1 for _ in run_dir.glob("config.segment-*.json"))
        (run_dir / f"config.segment-{k}.json").write_text(old)
    replace_text(path, text)
