"""The agent runner: environment handed to harnesses, timeouts with partial credit, invalid evaluations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.envs.base import EvalResult, Task
from gyre_ray.envs.toy import char_coverage_evaluator

ENDPOINT = Endpoint(base_url="http://127.0.0.1:9/", api_key="gyre-test-key")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_harness_sees_proxy_urls_key_and_task(exec_tmp: Path) -> None:
    code = (
        "import os, json; json.dump({k: os.environ[k] for k in "
        "['OPENAI_BASE_URL','OPENAI_API_KEY','ANTHROPIC_BASE_URL','GYRE_TASK_PROMPT']}, open('env.json','w'))"
    )
    task = Task("t", "do it", evaluate=lambda ws: EvalResult(1.0))
    out = run_execution("e1", task, ENDPOINT, exec_tmp / "ws", command=_py(code), timeout_s=30)
    import json

    env = json.loads((exec_tmp / "ws" / "env.json").read_text())
    assert env == {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "OPENAI_API_KEY": "gyre-test-key",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        "GYRE_TASK_PROMPT": "do it",
    }
    assert out.exit_code == 0 and not out.timed_out and out.reward == 1.0 and out.valid


def test_timeout_ends_the_harness_and_still_scores_the_workspace(exec_tmp: Path) -> None:
    # Writes half of the target characters, then hangs (with a child process) past the timeout.
    code = (
        "import subprocess, sys, time; open('answer.txt','w').write('aexx'); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    task = Task("vowels", "x", evaluate=char_coverage_evaluator("aeiu"))
    out = run_execution(
        "e2", task, ENDPOINT, exec_tmp / "ws", command=_py(code), timeout_s=6
    )  # room for a slow interpreter start on a busy machine
    assert out.timed_out and out.exit_code is None
    assert out.reward == pytest.approx(0.5 * 2 / 4 + 0.5 * 2 / 4)  # coverage 2/4, density 2/4
    assert out.valid and out.detail.startswith("timed out")
    assert out.duration_s < 20


def test_evaluator_crash_marks_the_execution_invalid(exec_tmp: Path) -> None:
    def broken(ws: Path) -> EvalResult:
        raise RuntimeError("judge unavailable")

    task = Task("t", "x", evaluate=broken)
    out = run_execution(
        "e3", task, ENDPOINT, exec_tmp / "ws", command=_py("pass"), timeout_s=30, eval_budget_s=1.5
    )
    assert not out.valid and "judge unavailable" in out.detail and "evaluator tries" in out.detail
    assert "judge unavailable" in out.reason


def test_seed_files_cannot_escape_the_workspace(exec_tmp: Path) -> None:
    task = Task("t", "x", evaluate=lambda ws: EvalResult(0.0), files={"../evil.txt": "x"})
    with pytest.raises(ValueError, match="escapes the workspace"):
        task.seed_workspace(exec_tmp / "ws")
    assert not (exec_tmp / "evil.txt").exists()


def test_a_harness_that_cannot_start_is_dropped_saying_so(
    exec_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing binary is 'harness could not start ...' in the step's drop reasons, not 'no model
    calls; harness exited with code 127' with the real error only in the execution's log."""
    from gyre_ray.agents import runner
    from gyre_ray.agents.outcomes import reason_kind

    monkeypatch.setattr(runner, "close_key", lambda endpoint, execution_id: 0)
    task = Task("t", "x", evaluate=lambda ws: EvalResult(1.0))
    out = run_execution(
        "e5",
        task,
        ENDPOINT,
        exec_tmp / "ws",
        command=["/nonexistent/my-agent"],
        timeout_s=30,
        require_calls=True,
    )
    assert not out.valid and reason_kind(out.reason) == "harness could not start '/nonexistent/my-agent'"
    assert "No such file or directory" in out.reason
    quiet = run_execution(
        "e6", task, ENDPOINT, exec_tmp / "ws2", command=_py("pass"), timeout_s=30, require_calls=True
    )
    assert not quiet.valid and reason_kind(quiet.reason) == "no model calls"
