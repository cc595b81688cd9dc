"""Run one execution: an agent harness as a subprocess in a fresh workspace, then evaluate it.

The harness gets the proxy's OpenAI and Anthropic base URLs and the execution's own API key in its
environment. A wall-clock timeout ends the harness's whole process group; the task's evaluator
then still scores the workspace it left (partial credit). An execution whose evaluation yields no
valid score is marked invalid and is dropped from training.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre_ray.envs.base import EvalResult, Task

HARNESSES = ("toy", "claude-code")


@dataclass(frozen=True)
class Endpoint:
    """Where the harness reaches the policy and which execution it speaks for."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    api_key: str


@dataclass
class ExecutionOutcome:
    """What became of one execution."""

    execution_id: str
    task_id: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    reward: float
    valid: bool
    detail: str
    log_tail: str

    def to_dict(self) -> dict:
        return asdict(self)


def harness_command(harness: str, task: Task) -> list[str]:
    """The command line that starts `harness` on `task`."""
    if harness == "toy":
        return [sys.executable, "-m", "gyre_ray.agents.toy_agent"]
    if harness == "claude-code":
        claude = shutil.which("claude") or str(Path(".cache/claude/node_modules/.bin/claude").resolve())
        return [claude, "-p", task.prompt, "--dangerously-skip-permissions"]
    raise ValueError(f"unknown harness {harness!r}; known: {', '.join(HARNESSES)}")


def harness_env(
    endpoint: Endpoint, task: Task, workspace: Path, extra: dict[str, str] | None
) -> dict[str, str]:
    """The subprocess environment: proxy URLs, the execution's key, the task, no telemetry."""
    env = dict(os.environ)
    env.update(
        {
            "OPENAI_BASE_URL": endpoint.base_url.rstrip("/") + "/v1",
            "OPENAI_API_KEY": endpoint.api_key,
            "ANTHROPIC_BASE_URL": endpoint.base_url.rstrip("/"),
            "ANTHROPIC_API_KEY": endpoint.api_key,
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "GYRE_TASK_PROMPT": task.prompt,
            "GYRE_WORKSPACE": str(workspace),
        }
    )
    env.update(extra or {})
    return env


def _end_process_group(proc: subprocess.Popen) -> None:
    """Terminate the harness and everything it spawned (its own session), then kill stragglers."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_execution(
    execution_id: str,
    task: Task,
    endpoint: Endpoint,
    workspace: Path,
    *,
    command: list[str],
    timeout_s: float,
    env_extra: dict[str, str] | None = None,
) -> ExecutionOutcome:
    """Run `command` in `workspace` until it exits or `timeout_s` passes, then evaluate the workspace."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    task.seed_workspace(workspace)
    log_path = workspace.parent / f"{workspace.name}.log"
    start = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=workspace,
            env=harness_env(endpoint, task, workspace, env_extra),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _end_process_group(proc)
    duration = time.monotonic() - start
    try:
        result = task.evaluate(workspace)
    except Exception as exc:  # an evaluator crash is an invalid evaluation, not a crashed job
        result = EvalResult(0.0, valid=False, detail=f"evaluator failed: {type(exc).__name__}: {exc}")
    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
    return ExecutionOutcome(
        execution_id=execution_id,
        task_id=task.task_id,
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        duration_s=duration,
        reward=float(result.reward),
        valid=bool(result.valid),
        detail=("timed out; " if timed_out else "") + result.detail,
        log_tail=tail,
    )
