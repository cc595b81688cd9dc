"""How a training run that cannot work says so: a run whose every execution was dropped ends with an
error and failed.json (not "done" with a checkpoint of nothing learned); a bad model.path, task file,
`command` harness or harness binary is refused before any Ray actor starts; failed.json holds the
cause of a Ray error, not its remote traceback with terminal colours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.agents.harnesses import codex_binary
from gyre_ray.config import ConfigError, load_config
from gyre_ray.train import FAILED_FILE, check_model_path, error_text, note_failure, nothing_scored


def test_a_run_that_scored_nothing_is_a_failure_naming_the_top_reasons() -> None:
    dropped = [
        {"reward_mean": None, "drop_reasons": {"no model calls": 7, "harness exited with code 1": 1}},
        {"reward_mean": None, "drop_reasons": {"no model calls": 8}},
    ]
    why = nothing_scored(dropped)
    assert why is not None and why.startswith("no execution was scored in any of the 2 step(s) (15 no model")
    assert "1 harness exited with code 1" in why and "workspaces/" in why
    assert nothing_scored([*dropped, {"reward_mean": 0.0}]) is None  # one scored step: it ran
    assert nothing_scored([]) is None


def test_failed_json_holds_the_cause_of_a_wrapped_error(tmp_path: Path) -> None:
    class Wrapped(Exception):  # how Ray hands back an actor's error: its text is the remote traceback
        def __init__(self) -> None:
            super().__init__(
                "\x1b[36mray::DualRoleCell.setup()\x1b[39m\nTraceback (most recent call last):\n ..."
            )
            self.cause = FileNotFoundError("no config.json in model folder /tmp/nope")

    assert error_text(Wrapped()) == "FileNotFoundError: no config.json in model folder /tmp/nope"
    note_failure(tmp_path, Wrapped(), quiet=True)
    assert json.loads((tmp_path / FAILED_FILE).read_text())["error"] == error_text(Wrapped())


def test_a_bad_model_path_task_file_or_command_harness_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path: no config.json in model folder"):
        check_model_path(load_config(None, [f"model.path={tmp_path}"]))
    broken = tmp_path / "tasks.jsonl"
    broken.write_text('{"id": "a", "prompt": "p", "hidden": "."}\n{"id": "b",\n')
    with pytest.raises(ConfigError, match="tasks.jsonl:2: not JSON"):
        load_config(None, [f"agents.task_set={broken}"])
    with pytest.raises(ConfigError, match="harness=command needs agents.command"):
        load_config(None, ["agents.harness=command"])


def test_a_harness_binary_named_in_the_environment_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODEX_BIN", "/nonexistent/codex")
    with pytest.raises(FileNotFoundError, match="CODEX_BIN=/nonexistent/codex is not an executable file"):
        codex_binary()
