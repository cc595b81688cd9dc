"""A resume never loses or doubles a step's metrics, never changes the run folder before its checkpoint
is restored, skips a damaged newest checkpoint for the newest good one, and refuses settings a resume
cannot take (model, dtype, task set, tasks per step) with one line, before Ray starts. Plain Python
(the driver's work around Ray is replaced by a stub), except the last test: the whole job, resumed
after its driver lost a step's row (`slow`, `extended`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gyre_ray import checkpoint, resume_checks
from gyre_ray import train as train_module
from gyre_ray.cli import main
from gyre_ray.config import ConfigError, load_config
from gyre_ray.model.arch import ModelArgs
from gyre_ray.resume import prepare_resume
from gyre_ray.train import resume_config, train

ROOT = Path(__file__).resolve().parents[1]


def _write_trainer(folder: Path, layers: int | None = None) -> None:
    """What `Trainer.save` writes, small: a tiny-preset config.json, a readable model.safetensors and
    trainer_state.pt (only headers and presence are checked before a resume)."""
    folder.mkdir(parents=True)
    config = ModelArgs.preset("tiny").to_hf_config()
    if layers is not None:
        config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    torch.save({"version": 1}, folder / "trainer_state.pt")


def _run_folder(root: Path, done: int = 2, overrides: tuple[str, ...] = ()) -> Path:
    """A toy run folder that did `done` steps (run.steps=done), a checkpoint after each step."""
    folder = root / "run"
    folder.mkdir()
    cfg = load_config(
        ROOT / "jobs/configs/toy.yaml",
        [f"run.steps={done}", f"run.run_dir={root}", "run.wandb_mode=disabled", *overrides],
    )
    (folder / "config.json").write_text(cfg.model_dump_json(indent=2))
    for step in range(1, done + 1):
        state = {"version": step, "seed": 0, "task_cursor": step * cfg.run.tasks_per_step}
        checkpoint.save(folder, step, _write_trainer, state, keep=0)
    _jsonl(folder / "metrics.jsonl", [{"step": s, "published_at_s": 1.0 + s} for s in range(done)])
    return folder


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`train` up to the runtime: what `_run_segments` is called with (its `start`) is recorded and
    it raises instead of starting Ray (a restore that fails, or the run that a refusal must prevent)."""
    calls: list[Any] = []

    def segments(cfg: Any, run_dir: Path, start: Any, *rest: Any) -> dict:
        calls.append(start)
        raise RuntimeError("the runtime would start here (restore failed)")

    monkeypatch.setattr(train_module, "_run_segments", segments)
    return calls


# ---- 1. a step published but never logged ------------------------------------------------------


def test_a_step_published_but_never_logged_comes_back_from_the_journal(tmp_path: Path) -> None:
    """The driver died after checkpoint step-000002 was written but before it polled step 1's row:
    the resume takes the row from the journal's `published` event (and step 2's, after the
    checkpoint, stays out), before the new scheduler starts the journal afresh."""
    _jsonl(tmp_path / "metrics.jsonl", [{"step": 0, "published_at_s": 2.0}])
    _jsonl(
        tmp_path / "scheduler-journal.jsonl",
        [
            {"run": {"steps": 4, "first_step": 0, "tag": ""}, "version": 0},
            {"published": 0, "version": 1, "metrics": {"step": 0, "published_at_s": 2.0}},
            {"published": 1, "version": 2, "metrics": {"step": 1, "published_at_s": 3.5, "reward_mean": 0.5}},
            {"published": 2, "version": 3, "metrics": {"step": 2, "published_at_s": 5.0}},
        ],
    )
    moved = prepare_resume(tmp_path, 2)
    assert moved["recovered"] == [1]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["published_at_s"]) for r in rows] == [(0, 2.0), (1, 3.5)]
    assert rows[1]["reward_mean"] == 0.5
    assert prepare_resume(tmp_path, 2)["recovered"] == [], "each step once"
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1]


def test_a_recovered_row_of_a_resumed_segment_gets_that_segments_clock(tmp_path: Path) -> None:
    """The journal's times start at its segment's start; the driver had added that segment's offset,
    read off a step both files hold (step 2 here: 100.0 - 1.0)."""
    _jsonl(tmp_path / "metrics.jsonl", [{"step": s, "published_at_s": 100.0 + s} for s in range(3)])
    _jsonl(
        tmp_path / "scheduler-journal.jsonl",
        [
            {"run": {"steps": 5, "first_step": 2, "tag": ""}, "version": 2},
            {"published": 2, "version": 3, "metrics": {"step": 2, "published_at_s": 3.0}},
            {
                "published": 3,
                "version": 4,
                "metrics": {"step": 3, "published_at_s": 4.0, "switches": [{"cell": "cell-1", "at_s": 3.5}]},
            },
        ],
    )
    prepare_resume(tmp_path, 4)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["published_at_s"]) for r in rows][-1] == (3, 103.0)
    assert rows[-1]["switches"][0]["at_s"] == 102.5  # its switch events on the run's clock too


def test_the_checkpoint_keeps_its_steps_row_when_the_journal_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler writes the step's row into state.json; a resume finds it there too."""
    import ray

    from gyre_ray.runtime.scheduler import RunScheduler

    @dataclasses.dataclass
    class Costs:
        micro_step_s: float = 0.2

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    core = SimpleNamespace(save=SimpleNamespace(remote=lambda folder: _write_trainer(Path(folder))))
    sched = SimpleNamespace(
        actors=[core], core=0, recorder=SimpleNamespace(start={}), ledger=SimpleNamespace(batch_of={}),
        updates=1, trainer_version=1, eta=0, costs=Costs(), run_dir=str(tmp_path),
        cfg=SimpleNamespace(run=SimpleNamespace(seed=0, tasks_per_step=2, keep_checkpoints=0)),
    )  # fmt: skip
    RunScheduler._checkpoint(sched, {"step": 0, "published_at_s": 1.5, "reward_mean": 0.25})
    saved = checkpoint.load_state(checkpoint.latest(tmp_path))
    assert saved["metrics"] == {"step": 0, "published_at_s": 1.5, "reward_mean": 0.25}
    assert prepare_resume(tmp_path, 1)["recovered"] == [0]
    assert _steps(tmp_path / "metrics.jsonl") == [0]


# ---- 2. a resume that fails leaves the folder's config -----------------------------------------


def test_a_resume_that_fails_before_its_restore_leaves_config_json(tmp_path: Path, no_ray: list) -> None:
    folder = _run_folder(tmp_path)
    before = (folder / "config.json").read_text()
    with pytest.raises(RuntimeError, match="restore failed"):
        train(resume_config(folder, ["run.steps=3"]), resume=folder)
    assert no_ray, "the resume got as far as the runtime"
    assert (folder / "config.json").read_text() == before, "a failed resume changes no config"
    assert not (folder / "failed.json").exists(), "the run is as resumable as before"
    assert resume_config(folder).run.steps == 2


def test_a_model_of_another_architecture_is_refused_before_ray(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    other = tmp_path / "other"
    _write_trainer(other, layers=3)
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", [f"model.path={other}"])
    with pytest.raises(ConfigError, match=r"another architecture than checkpoint step-000002 \("):
        resume_checks.check_checkpoint_model(cfg, checkpoint.latest(folder))
    own = resume_config(folder)  # the run's own model matches
    resume_checks.check_checkpoint_model(own, checkpoint.latest(folder))


def test_each_earlier_segments_config_is_kept(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("first")
    resume_checks.keep_config(tmp_path, "first")
    assert not list(tmp_path.glob("config.segment-*"))
    resume_checks.keep_config(tmp_path, "second")
    resume_checks.keep_config(tmp_path, "third")
    assert (tmp_path / "config.json").read_text() == "third"
    assert (tmp_path / "config.segment-1.json").read_text() == "first"
    assert (tmp_path / "config.segment-2.json").read_text() == "second"


# ---- 3. a damaged newest checkpoint --------------------------------------------------------------


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda t: (t / "model.safetensors").unlink(), "no model.safetensors"),
        (lambda t: (t / "model.safetensors").write_bytes(b"\x10\x00"), "not a readable safetensors"),
        (lambda t: (t / "trainer_state.pt").unlink(), "no trainer_state.pt"),
        (lambda t: (t / "trainer_state.pt").write_bytes(b""), "is empty"),
        (lambda t: (t / "trainer_state.pt").write_bytes(b"PK\x03\x04cut"), "not a whole torch file"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_good_one(
    tmp_path: Path, no_ray: list, capsys: pytest.CaptureFixture, damage: Any, said: str
) -> None:
    folder = _run_folder(tmp_path)
    damage(folder / "checkpoints" / "step-000002" / "trainer")
    with pytest.raises(RuntimeError, match="restore failed"):
        train(resume_config(folder, ["run.steps=3"]), resume=folder)
    assert no_ray[0][0].name == "step-000001" and no_ray[0][1] == 1
    (line,) = [
        x for x in capsys.readouterr().out.splitlines() if "skipping damaged" in x
    ]  # (the tmp path holds "damaged" too)
    assert "skipping damaged checkpoint" in line and "step-000002" in line and said in line


def test_no_good_checkpoint_is_one_line_and_exit_2(
    tmp_path: Path, no_ray: list, capsys: pytest.CaptureFixture
) -> None:
    folder = _run_folder(tmp_path)
    for step in (1, 2):
        (folder / "checkpoints" / f"step-00000{step}" / "trainer" / "trainer_state.pt").unlink()
    assert main(["train", "--resume", str(folder), "run.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot resume: no checkpoint of" in err[0] and "trainer_state.pt" in err[0]
    assert not no_ray


# ---- 4. settings a resume cannot change ------------------------------------------------------------


@pytest.mark.parametrize(
    "override, old, new",
    [
        ("model.dtype=float64", "float32", "float64"),
        ("agents.task_set=words", "toy", "words"),
        ("run.tasks_per_step=3", "2", "3"),
        ("model.path={other}", "None", "{other}"),
        ("run.eval_holdout=2", "1", "2"),  # would train on the task evaluated so far
        ("run.eval_task_set=words", "None", "words"),
        ("trainer.backend=megatron", "torch", "megatron"),  # its optimizer state is another file
    ],
)
def test_a_resume_refuses_a_setting_it_cannot_take(
    tmp_path: Path, no_ray: list, capsys: pytest.CaptureFixture, override: str, old: str, new: str
) -> None:
    folder = _run_folder(tmp_path)
    other = tmp_path / "other"
    _write_trainer(other)
    before = (folder / "config.json").read_text()
    given = override.format(other=other)
    assert main(["train", "--resume", str(folder), "run.steps=3", given]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    key = given.split("=")[0]
    assert f"{key} cannot change on resume" in line
    assert f"ran with {key}={old}" in line and f"given {key}={new.format(other=other)}" in line
    assert not no_ray and (folder / "config.json").read_text() == before


def test_a_resume_takes_the_settings_the_docs_allow(tmp_path: Path, no_ray: list) -> None:
    folder = _run_folder(tmp_path)
    cfg = resume_config(
        folder,
        ["run.steps=4", "cells.num_cells=1", "run.seed=3", "run.keep_checkpoints=1", "run.eval_every=2"],
    )
    with pytest.raises(RuntimeError, match="restore failed"):
        train(cfg, resume=folder)
    assert no_ray[0][1] == 2


def test_a_task_cursor_that_does_not_match_run_tasks_per_step_is_refused(tmp_path: Path) -> None:
    """config.json edited by hand: the checkpoint's own task cursor still says what the run did."""
    folder = _run_folder(tmp_path)
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", ["run.steps=3", "run.tasks_per_step=1"])
    with pytest.raises(ConfigError, match="run.tasks_per_step cannot change on resume"):
        train_module._resume_folder(cfg, folder, checkpoint.latest(folder))


# ---- the whole job ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.extended
def test_the_job_resumed_after_its_driver_lost_a_row_has_every_step_once() -> None:
    """2 steps of the toy job (a checkpoint after each); step 1's row is taken out of metrics.jsonl as
    a driver killed right after checkpoint step-000002 leaves it; `--resume` with run.steps=3 puts
    it back (journal), runs step 2, keeps the first segment's config and ends with steps 0, 1, 2."""
    from local_ray import private_ray

    root = Path(tempfile.mkdtemp(prefix="gyre-exec-test-"))  # outside pytest's basetemp (conftest.exec_tmp)
    overrides = [
        "run.steps=2", "run.tasks_per_step=1", "algo.group_size=2", "scheduler.staleness=0",
        "agents.toy_turns=1", "agents.toy_max_tokens=8", "run.checkpoint_every=1", "run.keep_checkpoints=0",
        "run.wandb_mode=disabled", f"run.run_dir={root}", "run.name=lost-row",
    ]  # fmt: skip
    try:
        with private_ray():
            first = train(load_config(ROOT / "jobs/configs/toy.yaml", overrides))
            folder = Path(first["run_dir"])
            rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
            _jsonl(folder / "metrics.jsonl", [r for r in rows if r["step"] != 1])
            resumed = train(resume_config(folder, ["run.steps=3"]), resume=folder)
        assert [m["step"] for m in resumed["steps"]] == [0, 1, 2]
        assert _steps(folder / "metrics.jsonl") == [0, 1, 2]
        assert resume_config(folder).run.steps == 3
        assert json.loads((folder / "config.segment-1.json").read_text())["run"]["steps"] == 2
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_recovered_rows_reach_wandb_once_when_the_resumed_run_starts(tmp_path: Path, monkeypatch) -> None:
    """wandb never got the step the driver missed; the resumed run's logger sends it first, once."""
    import sys

    from gyre_ray.observability.metrics import WANDB_PENDING_FILE, MetricsLogger

    logged: list[tuple[int, dict]] = []

    class FakeRun:
        def define_metric(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log(self, data: dict, step: int) -> None:
            logged.append((step, data))

        def finish(self) -> None:
            pass

    fake = SimpleNamespace(init=lambda **kwargs: FakeRun(), Settings=lambda **kwargs: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _jsonl(tmp_path / "metrics.jsonl", [{"step": 0, "published_at_s": 2.0}])
    _jsonl(
        tmp_path / "scheduler-journal.jsonl",
        [
            {"run": {"steps": 4, "first_step": 0, "tag": ""}, "version": 0},
            {"published": 1, "version": 2, "metrics": {"step": 1, "published_at_s": 3.5, "reward_mean": 0.5}},
        ],
    )
    assert prepare_resume(tmp_path, 2)["recovered"] == [1]
    assert (tmp_path / WANDB_PENDING_FILE).is_file()
    logger = MetricsLogger(tmp_path, "run", {}, "offline", resume=True)
    assert logged == [(1, {"published_at_s": 3.5, "reward_mean": 0.5})]
    assert logger.last_step == 1 and not (tmp_path / WANDB_PENDING_FILE).exists()
    logger.log(2, {"reward_mean": 0.75})
    MetricsLogger(tmp_path, "run", {}, "offline", resume=True)  # a second resume sends nothing again
    assert logged == [(1, {"published_at_s": 3.5, "reward_mean": 0.5}), (2, {"reward_mean": 0.75})]


def test_a_folder_without_a_checkpoint_fails_before_the_warm_up(
    tmp_path: Path, no_ray: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The warm-up (48 s for the default job) ran first, and cached itself under the working folder;
    and a resume that goes ahead runs none."""
    import gyre_ray.warmup.sft as sft

    warmed: list[Path] = []
    monkeypatch.setattr(sft, "prepare_policy", lambda cfg, root: warmed.append(root) or cfg)
    folder = _run_folder(tmp_path)
    shutil.rmtree(folder / "checkpoints")
    assert main(["train", "--resume", str(folder), "run.steps=3"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert warmed == [] and not no_ray
    (tmp_path / "other").mkdir()
    resumable = _run_folder(tmp_path / "other")
    with pytest.raises(RuntimeError, match="restore failed"):
        train(resume_config(resumable, ["run.steps=3"]), resume=resumable)
    # no warm-up again: the run's config.json holds the policy it prepared (model.path), the checkpoint
    # its weights (a resume used to train a fresh warm-up each time: its cache key never matched)
    assert warmed == []
