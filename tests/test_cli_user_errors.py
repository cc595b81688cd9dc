"""Bad input to the `gyre-ray` commands ends in one line naming the bad thing, exit code 2, and before
any slow work: an unknown flag gets the sub-command's own usage, a binary config, a torn weights file
or a checkpoint folder given for a model folder, an output path that cannot be written, a step
needing more tasks than the set has (before the warm-up); and
`generate` says when it samples from untrained weights, or takes a run's newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gyre_ray.checkpoint import CHECKPOINTS, STATE_FILE, TRAINER_DIR, checkpoint_name
from gyre_ray.cli import main
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import WEIGHTS_FILE, save_hf
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer


@pytest.fixture
def no_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up (a minute of supervised steps) fails the test: the input must be refused first."""

    def warm_up(*_: object) -> None:
        raise AssertionError("the warm-up ran before the input was checked")

    monkeypatch.setattr("gyre_ray.warmup.sft.prepare_policy", warm_up)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder holding one complete checkpoint of the tiny model."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.json").write_text("{}")
    saved = run_dir / CHECKPOINTS / checkpoint_name(3)
    args = ModelArgs.tiny()
    model = Qwen3ForCausalLM(args)
    init_weights(model, seed=1)
    save_hf(model, args, saved / TRAINER_DIR, Tokenizer.default())
    torch.save({"step": 3}, saved / TRAINER_DIR / "trainer_state.pt")  # what a good checkpoint holds
    (saved / STATE_FILE).write_text(json.dumps({"step": 3}))
    return run_dir


def test_an_unknown_flag_gets_the_sub_commands_usage(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: gyre-ray simulate") and "unrecognized arguments: --bogus" in err


def test_a_binary_config_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "bin.yaml"
    config.write_bytes(b"\xff\xfe\x00not yaml")
    code, _, err = run(capsys, "config", "--config", str(config))
    assert (
        code == 2
        and err.strip() == f"gyre-ray config: config {config} is not UTF-8 text (a YAML file was expected)"
    )


def test_a_torn_weights_file_or_a_checkpoint_folder_is_named(
    capsys: pytest.CaptureFixture, tmp_path: Path, checkpointed_run: Path
) -> None:
    trainer = checkpointed_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.json").write_text((trainer / "config.json").read_text())
    (torn / WEIGHTS_FILE).write_bytes((trainer / WEIGHTS_FILE).read_bytes()[:100])
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model-dir", str(torn))
    assert code == 2 and f"{torn / WEIGHTS_FILE} is not a readable safetensors file" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "eval", "--model-dir", str(torn))  # refused before Ray starts
    assert code == 2 and err.startswith("gyre-ray eval: cannot load the model: ") and "safetensors" in err
    code, _, err = run(capsys, "generate", "--prompt", "hi", f"model.path={trainer.parent}")
    assert code == 2 and f"(a checkpoint: its model is {trainer})" in err


def test_eval_refuses_unwritable_outputs_and_non_run_folders_up_front(
    capsys: pytest.CaptureFixture, tmp_path: Path, checkpointed_run: Path
) -> None:
    trainer = checkpointed_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    code, _, err = run(capsys, "eval", "--model-dir", str(trainer), "--json", str(tmp_path / "no" / "x.json"))
    assert code == 2 and f"its folder {tmp_path / 'no'} does not exist" in err
    a_file = tmp_path / "one.jsonl"
    a_file.write_text("")
    code, _, err = run(capsys, "eval", "--model-dir", str(trainer), "--out", str(a_file))
    assert code == 2 and f"--out {a_file} is a file" in err
    code, _, err = run(capsys, "eval", "--run", str(tmp_path / "nope"))
    assert (
        code == 2
        and err.strip() == f"gyre-ray eval: {tmp_path / 'nope'} is not a run folder (no config.json)"
    )


def test_generate_says_when_weights_are_untrained_and_takes_a_runs_checkpoint(
    capsys: pytest.CaptureFixture, checkpointed_run: Path
) -> None:
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "2", "--seed", "1")
    assert code == 0 and "randomly initialised weights" in err
    code, out, err = run(
        capsys, "generate", "--prompt", "hi", "--max-new-tokens", "3", "--seed", "1", "--temperature", "0",
        "--json", "--run", str(checkpointed_run),
    )  # fmt: skip
    assert code == 0 and "randomly initialised" not in err
    trainer = checkpointed_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    same = run(
        capsys, "generate", "--prompt", "hi", "--max-new-tokens", "3", "--seed", "1", "--temperature", "0",
        "--json", f"model.path={trainer}",
    )[1]  # fmt: skip
    assert json.loads(out) == json.loads(same)
    code, _, err = run(
        capsys, "generate", "--prompt", "hi", "--run", str(checkpointed_run), "--model-dir", "x"
    )
    assert code == 2 and "not both" in err
    # a folder named as YAML would read otherwise (`null`: no folder; " #": a comment) is that folder
    import shutil

    odd = checkpointed_run.parent / "null #copy"
    shutil.copytree(trainer, odd)
    code, out, err = run(
        capsys, "generate", "--prompt", "hi", "--max-new-tokens", "3", "--seed", "1", "--temperature", "0",
        "--json", "--model-dir", str(odd),
    )  # fmt: skip
    assert code == 0 and "randomly initialised" not in err and json.loads(out) == json.loads(same), err


def test_a_reader_that_stops_early_gets_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gyre-ray config --describe | head -1`: stdout is a pipe whose reader has gone; the command ends
    quietly (141) instead of raising BrokenPipeError (a closed pipe, so it happens on every machine)."""
    import os
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    closed = os.fdopen(write_end, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        assert main(["config", "--describe"]) == 141
    finally:
        closed.close()


def test_a_step_needing_more_tasks_than_the_set_has_is_refused_before_the_warm_up(
    capsys: pytest.CaptureFixture, tmp_path: Path, no_warm_up: None
) -> None:
    """It used to be found after the warm-up's minute of supervised steps."""

    code, out, err = run(
        capsys, "train", "--config", "jobs/configs/learn.yaml", "run.tasks_per_step=4", "run.eval_every=1",
        f"run.run_dir={tmp_path}",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.strip().startswith("gyre-ray train: run.tasks_per_step=4 but agents.task_set 'words' has 3 ")
    assert "after run.eval_holdout=1 held out" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_harness_not_installed_here_is_refused_up_front(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
    checkpointed_run: Path,
    no_warm_up: None,
) -> None:  # fmt: skip
    """A local run whose Claude Code is missing used to drop every execution for it (a whole step
    later); with no runner actors its executions run here, so the command says so at once."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("gyre_ray.agents.harnesses.claude_binary", lambda: None)

    argv = ["agents.harness=claude-code", f"run.run_dir={tmp_path / 'runs'}"]
    if command == "eval":
        argv = ["--run", str(checkpointed_run), "--out", str(tmp_path / "out"), *argv[:1]]
    code, out, err = run(capsys, command, *argv)
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray {command}: agents.harness=claude-code: Claude Code is not installed; run: make install-harnesses"
    )
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # on a cluster: where Ray puts them, unchecked
    from gyre_ray.agents.harnesses import check_harness_here
    from gyre_ray.config import load_config

    check_harness_here(load_config(None, ["agents.harness=claude-code"]).agents)


def test_a_run_dir_that_cannot_be_made_is_refused_before_the_warm_up(
    capsys: pytest.CaptureFixture, tmp_path: Path, no_warm_up: None
) -> None:
    """It failed with a traceback after the warm-up's minute, when the warm-up saved its cache."""

    (tmp_path / "afile").write_text("")
    code, out, err = run(
        capsys, "train", "--config", "jobs/configs/learn.yaml", f"run.run_dir={tmp_path}/afile/sub"
    )
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray train: run.run_dir='{tmp_path}/afile/sub': cannot make {tmp_path}/afile/sub: Not a directory"
    )


def test_eval_and_serve_check_their_input_before_ray_starts(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpointed_run: Path
) -> None:
    """An impossible held-out split (eval) and a missing model folder (serve) were found only once
    Ray, the store and the cells had started."""

    def no_ray(*_: object, **__: object) -> None:
        raise AssertionError("Ray started before the input was checked")

    monkeypatch.setattr("gyre_ray.runtime.cluster.Runtime.start", no_ray)
    monkeypatch.setattr("gyre_ray.proxy.launch.start_proxy", no_ray)
    code, out, err = run(
        capsys, "eval", "--run", str(checkpointed_run), "--out", str(tmp_path / "o"), "run.eval_holdout=50"
    )
    assert code == 2 and out == "" and "holding out run.eval_holdout=50 would leave none to train on" in err
    code, out, err = run(capsys, "serve", f"model.path={tmp_path / 'nowhere'}")
    assert code == 2 and out == "" and err.startswith("gyre-ray serve: model.path: ")
