"""`gyre-ray eval` / `generate` input handling: `eval --run` skips a damaged newest checkpoint with a
warning as `train --resume` does (none good: one line, exit 2); a run folder given to `--model-dir` or
`model.path` says so and points to `--run`; a `model.path=` override beside `--run` / `--model-dir` is
refused instead of silently replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre_ray.checkpoint import CHECKPOINTS, STATE_FILE, TRAINER_DIR, checkpoint_name
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import save_hf
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer
from tests.test_cli_user_errors import run

ROW = {"step": 3, "version": 3, "reward_mean": 0.5, "pass_rate": 0.5, "valid": 2, "executions": 2,
       "tasks": {"t": {"reward": 0.5, "pass_rate": 0.5, "valid": 2}}}  # fmt: skip


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with one complete, loadable checkpoint (step 3) of the tiny model."""
    run_dir = tmp_path_factory.mktemp("run") / "learn-1"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    saved = run_dir / CHECKPOINTS / checkpoint_name(3)
    args = ModelArgs.tiny()
    model = Qwen3ForCausalLM(args)
    init_weights(model, seed=1)
    save_hf(model, args, saved / TRAINER_DIR, Tokenizer.default())
    torch.save({"step": 3}, saved / TRAINER_DIR / "trainer_state.pt")
    (saved / STATE_FILE).write_text(json.dumps({"step": 3}))
    return run_dir


def _with_damaged_newest(good_run: Path, tmp_path: Path, state: str) -> Path:
    run_dir = tmp_path / good_run.name
    shutil.copytree(good_run, run_dir)
    newest = run_dir / CHECKPOINTS / checkpoint_name(4)
    shutil.copytree(run_dir / CHECKPOINTS / checkpoint_name(3), newest)
    (newest / STATE_FILE).write_text(state)
    return run_dir


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ("{garbage", "does not read (JSONDecodeError"),
        ('{"step": "x"}', "does not read (ValueError"),
        ("[4]", "holds no step number"),
        ("{}", "holds no step number"),
    ],  # fmt: skip
)
def test_eval_run_skips_a_damaged_newest_checkpoint_as_resume_does(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    state: str, why: str,
) -> None:  # fmt: skip
    calls: list[tuple[Path, int]] = []

    def fake_evaluate(cfg: Any, model_dir: Path, out: Path, step: int = 0) -> dict[str, Any]:
        calls.append((Path(model_dir), step))
        return ROW

    monkeypatch.setattr("gyre_ray.eval_cli.evaluate", fake_evaluate)
    run_dir = _with_damaged_newest(good_run, tmp_path, state)
    code, out, err = run(capsys, "eval", "--run", str(run_dir), "--json", "-")
    assert code == 0 and json.loads(out) == ROW  # stdout stays the JSON: the warning is on stderr
    damaged = run_dir / CHECKPOINTS / checkpoint_name(4)
    warning = err.splitlines()[0]
    assert warning.startswith(f"gyre-ray: warning: skipping damaged checkpoint {damaged}: {STATE_FILE} ")
    assert why in warning and "Traceback" not in err
    assert calls == [(run_dir / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR, 3)]


def test_eval_run_with_no_good_checkpoint_is_one_line(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = _with_damaged_newest(good_run, tmp_path, "{garbage")
    shutil.rmtree(run_dir / CHECKPOINTS / checkpoint_name(3))
    code, out, err = run(capsys, "eval", "--run", str(run_dir))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and "Traceback" not in err
    assert lines[-1].startswith(
        f"gyre-ray eval: cannot evaluate {run_dir}: no checkpoint of {run_dir} loads (the newest, "
        f"{checkpoint_name(4)}: {STATE_FILE} does not read"
    )
    assert all(line.startswith("gyre-ray: warning: skipping damaged") for line in lines[:-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--model-dir", "{run}"],
        ["generate", "--prompt", "hi", "--model-dir", "{run}"],
        ["generate", "--prompt", "hi", "model.path={run}"],
    ],
)
def test_a_run_folder_given_for_a_model_folder_points_to_run(
    good_run: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    code, out, err = run(capsys, *[a.format(run=good_run) for a in argv])
    flag = "model.path" if argv[-1].startswith("model.path") else "--model-dir"
    trainer = good_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray {argv[0]}: {flag} {good_run} is a run folder, not an HF model folder: give --run "
        f"{good_run} (its newest checkpoint) or a checkpoint's model folder, e.g. {trainer}"
    )


def test_a_run_folder_with_no_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"run": {}, "model": {}}))  # a run killed at once
    code, _, err = run(capsys, "eval", "--model-dir", str(tmp_path))
    assert code == 2 and "lacks required key" not in err
    assert f"--model-dir {tmp_path} is a run folder, not an HF model folder, and holds no complete" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--run", "{run}", "model.path=/elsewhere"],
        ["generate", "--prompt", "hi", "--model-dir", "{trainer}", "model.path=/elsewhere"],
        ["eval", "--run", "{run}", "model.path=/elsewhere"],
        ["eval", "--model-dir", "{trainer}", "model={path: /elsewhere}"],
    ],
)
def test_a_model_path_override_beside_run_or_model_dir_is_refused(
    good_run: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    trainer = good_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    code, out, err = run(
        capsys, *[a.replace("{run}", str(good_run)).replace("{trainer}", str(trainer)) for a in argv]
    )
    flag, given = ("--run", good_run) if "--run" in argv else ("--model-dir", trainer)
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray {argv[0]}: {flag} {given} names the model; drop {argv[-1]!r} (give one of them, not both)"
    )


def test_logprobs_points_a_run_folder_to_a_checkpoint_and_refuses_an_empty_token(
    good_run: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, err = run(capsys, "logprobs", "--model-dir", str(good_run), "--tokens", "1,2")
    trainer = good_run / CHECKPOINTS / checkpoint_name(3) / TRAINER_DIR
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray logprobs: --model-dir {good_run} is a run folder, not an HF model folder: give a "
        f"checkpoint's model folder (e.g. {trainer})"
    )
    code, _, err = run(capsys, "logprobs", "--model-dir", str(trainer), "--tokens", "1,,2")
    assert code == 2 and "got '1,,2' (an empty item)" in err
    code, out, _ = run(capsys, "logprobs", "--model-dir", str(trainer), "--tokens", "1,2,3")
    assert code == 0 and "over 2 predicted token(s)" in out
