"""The typed config tree: YAML files plus dotted command-line overrides.

`load_config("jobs/configs/toy.yaml", ["trainer.lr=1e-5"])` returns a validated `GyreConfig`.
Each section lives beside the code it configures (`gyre_ray/<area>/config.py`); this module
composes them, parses overrides and turns validation failures into `ConfigError`s that name
the dotted key and what is allowed there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from gyre_ray.agents.config import AgentSection, check_task_set
from gyre_ray.algo.config import AlgoSection
from gyre_ray.cells.config import CellsSection
from gyre_ray.configbase import Section
from gyre_ray.engines.config import EngineSection
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.config import ProxySection
from gyre_ray.scheduling.config import SchedulerSection
from gyre_ray.sim.config import SimSection
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.transfer.config import TransferSection
from gyre_ray.warmup.config import WarmupSection

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_STEPS = 1_000_000  # far past any run (a step takes seconds at least); a larger run.steps is a typo


class RunSection(Section):
    """What a training job does end to end."""

    name: str = Field(
        "toy",
        description="Run name (letters, digits, ., _, -): the run folder is <run_dir>/<name>-<timestamp>-<pid>.",
    )
    run_dir: str = Field("runs", description="Folder under which run folders are created.")
    steps: int = Field(
        1, ge=1, le=MAX_STEPS, description=f"RL steps (optimizer updates) to run (at most {MAX_STEPS:,})."
    )
    tasks_per_step: int = Field(2, ge=1, description="Distinct tasks per step; each runs group_size times.")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="wandb mode (offline needs no network; `wandb sync` uploads later)."
    )
    seed: int = Field(
        0,
        description="Seed of the run's draws: the toy harness's request seeds and a longtail task's tool "
        "sleeps come from it and each execution's name (0: the default draws); the model's weights use "
        "model.seed.",
    )
    checkpoint_every: int = Field(
        5,
        ge=0,
        description="Write a checkpoint (weights, optimizer, version, RNG, step) into <run folder>/checkpoints "
        "every N steps and after the last one; `gyre-ray train --resume RUN_DIR` continues from the newest "
        "(0 = only the final model, no resume).",
    )
    keep_checkpoints: int = Field(2, ge=0, description="Newest checkpoints kept in the run folder (0 = all).")
    max_core_restarts: int = Field(
        2,
        ge=0,
        description="If the core cell dies, restart the run from its newest checkpoint (or from step 0 if "
        "there is none yet) at most this many times; 0 = a dead core ends the run with an error.",
    )
    max_scheduler_restarts: int = Field(
        3,
        ge=0,
        description="If the scheduler actor dies, Ray restarts it at most this many times in a run; the "
        "restarted one replays its journal, reattaches to the running executions and cells and finishes "
        "the step (docs/faults.md). 0 = a dead scheduler ends the run.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate the policy on the held-out tasks before training and every N steps (and "
        "after the last); never trained on. 0 = off.",
    )
    eval_task_set: str | None = Field(
        None,
        description="Task set to evaluate on (a name or a task file); unset = the last `eval_holdout` tasks "
        "of agents.task_set, which training then skips.",
    )
    eval_holdout: int = Field(
        1, ge=1, description="Tasks of agents.task_set held out for evaluation when eval_task_set is unset."
    )
    eval_samples: int = Field(
        2, ge=1, description="Executions per held-out task in one evaluation (fixed seeds across rounds)."
    )
    eval_pass_threshold: float = Field(
        1.0, ge=0.0, le=1.0, description="An evaluated execution passes when its reward is at least this."
    )
    dashboard: bool = Field(
        False,
        description="A private local Ray starts its dashboard too (a cluster's Ray has its own). "
        "Metrics are exported on `metrics_export_port` either way when it is set.",
    )
    metrics_export_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="Port where a private local Ray serves Prometheus metrics (gyre's included: "
        "deployments/grafana/gyre-ray.json); keep it outside Ray's worker ports 10002-19999.",
    )

    @field_validator("name")
    @classmethod
    def _folder_safe_name(cls, value: str) -> str:
        if not RUN_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a run name: it names a folder and a Ray namespace, so letters, digits, "
                "'.', '_' and '-' only, starting with a letter or digit, at most 64 characters"
            )
        return value

    @field_validator("eval_task_set")
    @classmethod
    def _eval_task_set(cls, value: str | None) -> str | None:
        return None if value is None else check_task_set(value)

    @field_validator("metrics_export_port")
    @classmethod
    def _outside_worker_ports(cls, value: int | None) -> int | None:
        if value is not None and 10002 <= value <= 19999:
            raise ValueError(f"{value} is inside Ray's worker port range 10002-19999; pick another port")
        return value


class GyreConfig(Section):
    """Root of the config tree."""

    run: RunSection = Field(default_factory=RunSection, description="The job.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    engine: EngineSection = Field(default_factory=EngineSection, description="Rollout engine.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Trainer.")
    trajectory: TrajectorySection = Field(default_factory=TrajectorySection, description="Tree processing.")
    algo: AlgoSection = Field(default_factory=AlgoSection, description="Objective.")
    agents: AgentSection = Field(default_factory=AgentSection, description="Agent harness and tasks.")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Scheduling.")
    sim: SimSection = Field(default_factory=SimSection, description="Simulator.")
    proxy: ProxySection = Field(default_factory=ProxySection, description="Agent proxy.")
    transfer: TransferSection = Field(
        default_factory=TransferSection,
        description="What moves between cells (weights, gradients, KV), and how.",
    )
    cells: CellsSection = Field(default_factory=CellsSection, description="Cells (placement groups).")
    warmup: WarmupSection = Field(
        default_factory=WarmupSection, description="Supervised warm-up before RL (off by default)."
    )

    @model_validator(mode="after")
    def _async_leaves_a_rollout_cell(self) -> GyreConfig:
        cells, sched = self.cells.num_cells, self.scheduler
        if sched.policy == "async" and sched.async_split(cells) >= cells:
            given = (
                f"scheduler.async_train_cells={sched.async_train_cells}, " if sched.async_train_cells else ""
            )
            raise ValueError(
                f"scheduler.policy=async trains on a fixed {sched.async_split(cells)} of the cells and rolls "
                f"out on the rest, but {given}cells.num_cells={cells} leaves no rollout cell: give "
                "cells.num_cells >= 2 and scheduler.async_train_cells < cells.num_cells (0 = half)"
            )
        return self

    @model_validator(mode="after")
    def _warm_up_only_with_the_toy_harness(self) -> GyreConfig:
        if self.warmup.steps > 0 and self.agents.harness != "toy":
            raise ValueError(
                f"warmup.steps={self.warmup.steps} trains on the toy harness's transcripts, but "
                f"agents.harness={self.agents.harness}: set warmup.steps=0 (or agents.harness=toy)"
            )
        return self

    @model_validator(mode="after")
    def _megatron_weight_dtype(self) -> GyreConfig:
        if self.trainer.backend == "megatron" and self.model.dtype == "float64":
            raise ValueError(
                "trainer.backend=megatron trains float32, bfloat16 or float16 weights, not "
                "model.dtype=float64: give another model.dtype (or trainer.backend=torch)"
            )
        return self

    @model_validator(mode="after")
    def _a_gpu_per_megatron_rank(self) -> GyreConfig:
        ranks, gpus = self.trainer.megatron_ranks, self.cells.gpus_per_cell
        if self.trainer.backend == "megatron" and ranks > 1 and 0 < gpus < ranks:  # (one rank: in-process)
            raise ValueError(
                f"trainer.tensor_parallel_size x trainer.context_parallel_size = {ranks} Megatron ranks per "
                f"cell, but cells.gpus_per_cell={gpus:g}: rank r runs on the cell's GPU r, so give "
                f"cells.gpus_per_cell >= {ranks} (or fewer ranks)"
            )
        return self


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


def _allowed_keys(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    """Field names allowed at `path` (the parent of an offending key) in the tree rooted at `model`."""
    current: Any = model
    for part in path:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = fields[part].annotation
    return sorted(getattr(current, "model_fields", {}))


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in err.errors():
        loc = tuple(item["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(GyreConfig, loc[:-1])
            lines.append(f"  {key}: unknown key; allowed here: {', '.join(allowed)}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "value_error" and (not loc or isinstance(item.get("input"), dict)):
            # a check across keys (of the whole config or a section): its message names them
            lines.append(f"  {key}: {message}" if loc else f"  {message}")
        else:
            lines.append(f"  {key}: {message} (got {item.get('input')!r})")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        own = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
        self.flatten_mapping(node)  # merge keys (`<<: *anchor`) go first: the mapping's own may override them
        merged = len(node.value) - own
        seen: set[Any] = set()
        for index, (key_node, _) in enumerate(node.value):
            key = self.construct_object(key_node, deep=deep)
            if index < merged:  # a key a merge brought in: the mapping's own keys may override it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a","b","c"], parsed value); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    parts = [p.strip() for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(
            f"override {text!r}: key {key.strip()!r} has an empty part (look for '..' or a '.' at an end)"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set (intermediate tables are created)."""
    merged = yaml.safe_load(yaml.safe_dump(data)) or {}
    for text in overrides:
        parts, value = parse_override(text)
        node = merged
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return merged


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping as written (not validated, no defaults filled in), so that a caller
    can tell which keys the file sets; `ConfigError` when it does not read as one."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text (a YAML file was expected)") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GyreConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    data = read_config_file(path) if path is not None else {}
    source = "defaults" if path is None else str(path)
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + overrides"
    return validate_config(data, source)


def validate_config(data: dict[str, Any], source: str) -> GyreConfig:
    """`data` as a config; `ConfigError` naming every bad key (and `source`) if it is not one."""
    try:
        return GyreConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def describe(model: type[BaseModel] = GyreConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """Every leaf field as (dotted key, default, description), for docs and `gyre-ray config`."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe(ann, key + "."))
        else:
            default = field.get_default(call_default_factory=True)
            rows.append((key, repr(default), field.description or ""))
    return rows
