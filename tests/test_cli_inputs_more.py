"""More `gyre-ray` input handling, each a one-line error (exit 2) or an honoured input, never a traceback
or input dropped silently: `generate --run` skips a damaged newest checkpoint as `eval --run` does; a
`model.path` in the `--config` file beside `--run` / `--model-dir` is refused like the override; `eval`
honours a `proxy.records_dir` it is given; `--config` given twice is refused on every command; a
checkpoint's state.json step must be a JSON integer >= 0; `run.steps` has an upper bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gyre_ray import checkpoint
from gyre_ray.checkpoint import CHECKPOINTS, STATE_FILE, TRAINER_DIR, checkpoint_name
from gyre_ray.config import MAX_STEPS, ConfigError, load_config
from gyre_ray.model.checkpoint import WEIGHTS_FILE
from gyre_ray.proxy.config import ProxySection
from tests import test_cli_inputs_eval
from tests.test_checkpoint import _write_loadable
from tests.test_cli_inputs_eval import _with_damaged_newest
from tests.test_cli_user_errors import run

good_run = test_cli_inputs_eval.good_run  # its module-scoped fixture: a run with a good step-3 checkpoint

GENERATE = ("generate", "--prompt", "hi", "--max-new-tokens", "2", "--seed", "1", "--temperature", "0")


def _trainer(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / checkpoint_name(step) / TRAINER_DIR


def _cut_weights(run_dir: Path, step: int) -> None:
    weights = _trainer(run_dir, step) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])


@pytest.mark.parametrize("damage", ["weights", "string step"])
def test_generate_run_skips_a_damaged_newest_checkpoint(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damage: str
) -> None:
    run_dir = _with_damaged_newest(
        good_run, tmp_path, json.dumps({"step": 4 if damage == "weights" else "4"})
    )
    if damage == "weights":
        _cut_weights(run_dir, 4)
    code, out, err = run(capsys, *GENERATE, "--json", "--run", str(run_dir))
    damaged = run_dir / CHECKPOINTS / checkpoint_name(4)
    assert code == 0 and "Traceback" not in err
    assert err.splitlines()[0].startswith(f"gyre-ray: warning: skipping damaged checkpoint {damaged}: ")
    same = run(capsys, *GENERATE, "--json", f"model.path={_trainer(run_dir, 3)}")[1]
    assert json.loads(out) == json.loads(same)  # the step-3 policy


def test_generate_run_with_no_good_checkpoint_is_one_line(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = _with_damaged_newest(good_run, tmp_path, json.dumps({"step": 4}))
    _cut_weights(run_dir, 4)
    shutil.rmtree(run_dir / CHECKPOINTS / checkpoint_name(3))
    code, out, err = run(capsys, *GENERATE, "--run", str(run_dir))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and "Traceback" not in err
    assert lines[-1].startswith(
        f"gyre-ray generate: --run {run_dir}: no checkpoint of {run_dir} loads (the newest, "
        f"{checkpoint_name(4)}: "
    )
    assert all(line.startswith("gyre-ray: warning: skipping damaged") for line in lines[:-1])


@pytest.mark.parametrize(
    "argv",
    [
        [*GENERATE, "--run", "{run}"],
        [*GENERATE, "--model-dir", "{trainer}"],
        ["eval", "--model-dir", "{trainer}"],
    ],
)
def test_a_model_path_in_the_config_file_beside_run_or_model_dir_is_refused(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("model:\n  path: /elsewhere\n")
    trainer = _trainer(good_run, 3)
    words = [a.replace("{run}", str(good_run)).replace("{trainer}", str(trainer)) for a in argv]
    code, out, err = run(capsys, *words, "--config", str(config))
    flag, given = ("--run", good_run) if "--run" in argv else ("--model-dir", trainer)
    assert code == 2 and out == ""
    assert err.strip() == (
        f"gyre-ray {argv[0]}: {flag} {given} names the model; drop model.path in {config} "
        "(give one of them, not both)"
    )


def test_a_config_file_leaving_model_path_at_its_default_goes_with_run(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("model:\n  path: null\n  seed: 3\n")
    code, out, err = run(capsys, *GENERATE, "--json", "--run", str(good_run), "--config", str(config))
    assert code == 0 and "randomly initialised" not in err
    assert json.loads(out) == json.loads(run(capsys, *GENERATE, "--json", "--run", str(good_run))[1])


class _Started(Exception):
    """Raised by the stand-in `Runtime.start`, carrying the config the round would have run with."""

    def __init__(self, cfg: Any) -> None:
        super().__init__("started")
        self.cfg = cfg


@pytest.mark.parametrize("given", [None, "override", "config file", "config file, the default"])
def test_eval_honours_a_records_dir_it_is_given(
    good_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    given: str | None
) -> None:  # fmt: skip
    def start(cfg: Any, *args: Any, **kwargs: Any) -> None:
        raise _Started(cfg)

    monkeypatch.setattr("gyre_ray.runtime.cluster.Runtime.start", start)
    records, out = tmp_path / "my-records", tmp_path / "out"
    argv = ["eval", "--model-dir", str(_trainer(good_run, 3)), "--out", str(out)]
    if given == "override":
        argv.append(f"proxy.records_dir={records}")
    elif given is not None:  # a value the file gives is honoured, even the default's
        if given.endswith("the default"):
            records = Path(ProxySection().records_dir)
        (tmp_path / "job.yaml").write_text(f"proxy:\n  records_dir: {records}\n")
        argv += ["--config", str(tmp_path / "job.yaml")]
    with pytest.raises(_Started) as started:
        run(capsys, *argv)
    want = out.resolve() / "records" if given is None else records
    assert Path(started.value.cfg.proxy.records_dir) == want
    assert Path(started.value.cfg.model.path) == _trainer(good_run, 3).resolve()


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "--config", "a.yaml", "--config", "b.yaml"],
        ["train", "--config=a.yaml", "--config", "b.yaml"],
        ["eval", "--model-dir", "m", "--config", "a.yaml", "--conf", "b.yaml"],
        ["generate", "--prompt", "hi", "--config", "a.yaml", "--config", "b.yaml"],
        ["simulate", "--config", "a.yaml", "--config", "b.yaml"],
        ["train", "--resume", "a.yaml", "--resume", "b.yaml"],
        ["eval", "--run", "a.yaml", "--run", "b.yaml"],
    ],
)
def test_config_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # neither file exists: nothing can start
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    option = "--config" if "conf" in argv[-2] else argv[-2]  # also --resume, --run: the first was dropped
    assert err.strip() == (
        f"gyre-ray {argv[0]}: {option} given twice (a.yaml, then b.yaml): give it once (a second one "
        "would replace the first, not add to it)"
    )


@pytest.mark.parametrize(
    ("state", "shown"), [({"step": "3"}, '"3"'), ({"step": True}, "true"), ({"step": -1}, "-1")]
)
def test_a_state_step_must_be_a_json_integer(tmp_path: Path, state: dict, shown: str) -> None:
    saved = checkpoint.save(tmp_path, 3, _write_loadable, {})
    assert checkpoint.problem(saved) is None
    (saved / STATE_FILE).write_text(json.dumps(state))
    assert checkpoint.problem(saved) == (
        f"{STATE_FILE} does not read (ValueError: its step is {shown}, not a JSON integer >= 0)"
    )


def test_run_steps_has_an_upper_bound(capsys: pytest.CaptureFixture) -> None:
    assert load_config(None, [f"run.steps={MAX_STEPS}"]).run.steps == MAX_STEPS
    with pytest.raises(ConfigError, match=r"run\.steps: Input should be less than or equal to 1000000"):
        load_config(None, [f"run.steps={10**23}"])
    for job in sorted((Path(__file__).parents[1] / "jobs" / "configs").glob("*.yaml")):
        assert load_config(job).run.steps <= MAX_STEPS
    code, out, _ = run(capsys, "config", "--describe")
    assert code == 0 and f"(at most {MAX_STEPS:,})" in next(
        line for line in out.splitlines() if "run.steps" in line
    )
