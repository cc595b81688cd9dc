"""The config tree: shipped configs parse, overrides apply, bad keys and types are named clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gyre_ray.config import ConfigError, GyreConfig, describe, load_config

ROOT = Path(__file__).resolve().parents[1]
# gyre-ray configs and Serve configs; KubeRay manifests have their own test (test_kuberay_manifests.py)
SHIPPED = sorted(
    p for d in ("jobs", "deployments") for p in (ROOT / d).rglob("*.yaml") if "kuberay" not in p.parts
)


def test_there_are_shipped_configs() -> None:
    assert any(p.name == "toy.yaml" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_parses(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and "applications" in data:  # a Ray Serve config: check its gyre-ray args
        for app in data["applications"]:
            args = app.get("args") or {}
            assert isinstance(load_config(args.get("config"), args.get("overrides") or []), GyreConfig)
        return
    assert isinstance(load_config(path), GyreConfig)


def test_dotted_overrides_are_typed() -> None:
    cfg = load_config(None, ["trainer.lr=3e-6", "scheduler.policy=colocate", "trainer.betas=[0.8, 0.9]"])
    assert cfg.trainer.lr == pytest.approx(3e-6)
    assert cfg.scheduler.policy == "colocate"
    assert cfg.trainer.betas == (0.8, 0.9)


def test_unknown_key_names_the_key_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.learning_rate=1e-5"])
    text = str(err.value)
    assert "trainer.learning_rate: unknown key" in text and "lr" in text


def test_unknown_section_is_named() -> None:
    with pytest.raises(ConfigError, match="trainerr: unknown key; allowed here: .*trainer"):
        load_config(None, ["trainerr.lr=1"])


def test_wrong_type_and_range_are_named() -> None:
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_config(None, ["trainer.lr=fast"])
    with pytest.raises(ConfigError, match="scheduler.policy"):
        load_config(None, ["scheduler.policy=round-robin"])


def test_override_syntax_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="is not a section"):
        load_config(None, ["trainer.lr=1", "trainer.lr.x=2"])


@pytest.mark.parametrize("override", ["run..steps=7", ".run.steps=7", "run.steps.=7", " .steps=7"])
def test_an_override_key_with_an_empty_part_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match="has an empty part"):
        load_config(None, [override])


@pytest.mark.parametrize("name", ["", "../escaped", "a/b", "-dash", "x" * 65, "a b"])
def test_a_run_name_that_is_not_a_plain_folder_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="run.name: .* is not a run name"):
        load_config(None, [f"run.name={name}"] if name else ["run.name=''"])
    assert load_config(None, ["run.name=learn-2.v1_a"]).run.name == "learn-2.v1_a"


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text("run:\n  steps: 2\nrun:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="key 'run' is given twice"):
        load_config(config)
    config.write_text("run:\n  steps: 2\n  steps: 3\n")
    with pytest.raises(ConfigError, match="key 'steps' is given twice"):
        load_config(config)
    # a merge key's keys may be overridden by the mapping's own: that is no key given twice
    config.write_text("trainer: {<<: {lr: 0.5, grad_clip: 3.0}, grad_clip: 2.0}\n")
    loaded = load_config(config)
    assert (loaded.trainer.lr, loaded.trainer.grad_clip) == (0.5, 2.0)


def test_bad_yaml_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_every_field_has_a_description() -> None:
    missing = [key for key, _default, text in describe() if not text.strip()]
    assert missing == []


@pytest.mark.parametrize(
    "overrides",
    [
        ["scheduler.policy=async", "cells.num_cells=1"],
        ["scheduler.policy=async", "cells.num_cells=3", "scheduler.async_train_cells=3"],
    ],
)
def test_async_without_a_rollout_cell_is_refused_before_anything_starts(overrides: list[str]) -> None:
    """It passed the config and failed after Ray, the cells and the proxy had started."""
    with pytest.raises(ConfigError, match="leaves no rollout cell: give cells.num_cells >= 2") as err:
        load_config(None, overrides)
    assert "<root>" not in str(err.value) and "(got {" not in str(err.value)
    allowed = load_config(
        None, ["scheduler.policy=async", "cells.num_cells=3", "scheduler.async_train_cells=2"]
    )
    assert allowed.scheduler.async_split(allowed.cells.num_cells) == 2


def test_a_group_of_one_is_refused() -> None:
    """GSPO's advantages are relative within a group: a group of one trained nothing, silently."""
    with pytest.raises(ConfigError, match="algo.group_size: Input should be greater than or equal to 2"):
        load_config(None, ["algo.group_size=1"])


@pytest.mark.parametrize("override", ["trainer.lr=inf", "trainer.lr=.nan", "agents.timeout_s=.inf"])
def test_a_number_that_is_not_finite_is_refused_in_every_section(override: str) -> None:
    """`trainer.lr=inf` passed (`nan` only because of its range): every section wants finite numbers."""
    with pytest.raises(ConfigError, match="Input should be a finite number"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.context_parallel_size=2"], "needs trainer.backend=megatron"),
        (["trainer.tensor_parallel_size=2"], "needs trainer.backend=megatron"),
        (["trainer.backend=megatron", "model.dtype=float64"], "not model.dtype=float64"),
        (
            ["trainer.backend=megatron", "trainer.context_parallel_size=2", "trainer.megatron_attention=dense"],
            "needs trainer.megatron_attention=tree",
        ),
        (
            ["trainer.backend=megatron", "trainer.tensor_parallel_size=2", "trainer.context_parallel_size=2",
             "cells.gpus_per_cell=2"],
            "4 Megatron ranks per cell, but cells.gpus_per_cell=2",
        ),
    ],
)  # fmt: skip
def test_context_parallel_settings_that_cannot_run_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    ok = load_config(
        None, ["trainer.backend=megatron", "trainer.context_parallel_size=2", "cells.gpus_per_cell=2"]
    )
    assert ok.trainer.megatron_ranks == 2
    one_rank = load_config(None, ["trainer.backend=megatron", "cells.gpus_per_cell=0.5"])  # runs in-process
    assert one_rank.trainer.megatron_ranks == 1 and one_rank.cells.gpus_per_cell == 0.5
