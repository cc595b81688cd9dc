"""Run one execution: an agent harness in a sandbox with a fresh workspace, then evaluate it.

The harness runs as the execution's own uid where possible (`gyre_ray.agents.sandbox`), with its
own workspace, HOME and TMPDIR, an environment allowlist holding the proxy's OpenAI and Anthropic
base URLs and the execution's own API key, and limits on processes, memory, file size, disk and
wall time; its whole process tree ends with it. The task's evaluator then scores the workspace,
also after a timeout or a killed run (partial credit), retried within `eval_budget_s` while it
yields no valid score. Whatever the harness does, the outcome is a scored or a dropped execution
with its reason, never an exception:

- no model calls at all: dropped ("no model calls"), there is nothing to train on;
- no valid evaluation within the budget: dropped with the evaluator's reason;
- a timeout, a limit, a non-zero exit: scored, the reason kept alongside the reward.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre_ray.agents.sandbox import (
    Identity,
    Limits,
    acquire_identity,
    harness_env,
    make_private,
    prepare_folders,
    reclaim,
)
from gyre_ray.agents.supervise import Finished, supervise
from gyre_ray.envs.base import EvalContext, EvalResult, Task, evaluate_with_retries
from gyre_ray.envs.untrusted import UntrustedFileError, read_untrusted, remove_entries
from gyre_ray.json_values import is_int


@dataclass(frozen=True)
class Endpoint:
    """Where the harness reaches the policy and which execution it speaks for."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    api_key: str


@dataclass
class ExecutionOutcome:
    """What became of one execution. `reason`: why it was dropped (valid=False) or what went wrong
    in a scored one (e.g. a timeout); empty when it ran cleanly."""

    execution_id: str
    task_id: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    reward: float
    valid: bool
    detail: str
    log_tail: str
    reason: str = ""
    calls: int | None = None  # model calls the proxy recorded (None: not known)

    def to_dict(self) -> dict:
        return asdict(self)


def close_key(endpoint: Endpoint, execution_id: str) -> int | None:
    """Revoke the execution's key now that its harness has ended (so nothing it left behind, such as
    code its judge runs, calls the model under it: at once with one proxy replica, the default; other
    replicas stop taking it within `KEY_TTL_S`, 5 s), with that key; returns the model calls the
    proxy recorded (None when it can't say: the key is then revoked when the step finishes the
    execution).
    One small answer: reading the records to count them moved every prompt of an hours-long
    execution (hundreds of MB) through the record store, which every model call waits on."""
    url = f"{endpoint.base_url.rstrip('/')}/gyre/executions/{execution_id}/close"
    request = urllib.request.Request(
        url, method="POST", data=b"", headers={"Authorization": f"Bearer {endpoint.api_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            count = json.loads(response.read())["records"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return count if is_int(count) else None


def _harness_reason(finished: Finished) -> str:
    parts = []
    if finished.timed_out:
        parts.append("timed out")
    if finished.limit:
        parts.append(f"killed at its {finished.limit}")
    if finished.exit_code not in (None, 0):
        parts.append(f"harness exited with code {finished.exit_code}")
    if finished.leftovers:
        parts.append("processes survived the kill")
    return "; ".join(parts)


@dataclass(frozen=True)
class _Options:
    command: list[str]
    timeout_s: float
    env_extra: dict[str, str]
    limits: Limits
    eval_budget_s: float
    passthrough: tuple[str, ...]
    home_files: dict[str, str]
    require_calls: bool


# what `gyre_ray.agents.limits` prints when the harness's command cannot be executed (exit 127)
START_FAILURE = re.compile(r"gyre-ray: cannot start ('[^'\n]*'|\"[^\"\n]*\"): ([^\n]*)")


def run_execution(
    execution_id: str,
    task: Task,
    endpoint: Endpoint,
    workspace: Path,
    *,
    command: list[str],
    timeout_s: float,
    env_extra: dict[str, str] | None = None,
    isolation: str = "auto",
    limits: Limits | None = None,
    eval_budget_s: float = 120.0,
    passthrough: tuple[str, ...] = (),
    home_files: dict[str, str] | None = None,
    require_calls: bool = False,
) -> ExecutionOutcome:
    """Run `command` in `workspace` until it exits, `timeout_s` passes or a limit is hit; evaluate.

    `isolation`: see `sandbox.acquire_identity`; `passthrough`: job variables the harness may see;
    `home_files`: files written under its HOME first; `require_calls`: drop the execution when the
    proxy recorded no model call for it."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    options = _Options(
        list(command), timeout_s, dict(env_extra or {}), limits or Limits(), eval_budget_s,
        tuple(passthrough), dict(home_files or {}), require_calls,
    )  # fmt: skip
    identity = acquire_identity(isolation)
    try:
        return _run(identity, execution_id, task, endpoint, workspace, options)
    finally:
        reclaim(identity)


def _run(
    identity: Identity, execution_id: str, task: Task, endpoint: Endpoint, workspace: Path, opts: _Options
) -> ExecutionOutcome:
    home, tmp = workspace.parent / f"{workspace.name}.home", workspace.parent / f"{workspace.name}.tmp"
    scratch = workspace.parent / f"{workspace.name}.eval"
    log_path = workspace.parent / f"{workspace.name}.log"
    eval_log = workspace.parent / f"{workspace.name}.eval.log"  # the job's: the uid cannot replace it
    # what an earlier run left (a rerun of `gyre-ray eval --out DIR` reuses the folders), never through
    # a link its agent planted: the job seeds and writes them as root
    remove_entries(workspace, home, tmp, scratch, log_path, eval_log)
    task.seed_workspace(workspace)
    for rel, text in opts.home_files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    prepare_folders(identity, workspace, home, tmp)
    hidden = getattr(task.evaluate, "hidden", None)
    if hidden is not None and identity.dedicated:
        make_private(hidden)  # the agent never sees the hidden tests, not even where the task file is
    values = {
        "OPENAI_BASE_URL": endpoint.base_url.rstrip("/") + "/v1",
        "OPENAI_API_KEY": endpoint.api_key,
        "ANTHROPIC_BASE_URL": endpoint.base_url.rstrip("/"),
        "ANTHROPIC_API_KEY": endpoint.api_key,
        "GYRE_API_KEY": endpoint.api_key,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "GYRE_TASK_PROMPT": task.prompt,
        "GYRE_WORKSPACE": str(workspace),
        **opts.env_extra,
    }
    env = harness_env(identity, home, tmp, values, opts.passthrough)
    watch = [workspace, home, tmp]
    finished = supervise(
        opts.command, identity=identity, cwd=workspace, env=env, log_path=log_path,
        timeout_s=opts.timeout_s, limits=opts.limits, watch=watch,
    )  # fmt: skip
    recorded = close_key(endpoint, execution_id)  # before the judge runs what the agent left
    calls = recorded if opts.require_calls else None
    reason = _harness_reason(finished)

    # the evaluator gets a HOME and TMPDIR of its own, not the agent's (where a `.pth`, a .gitconfig or
    # a shell profile the agent left would run inside the judge), and no user site-packages
    eval_home, eval_tmp = scratch / "home", scratch / "tmp"

    def run_command(cmd: list[str], cwd: Path, timeout: float, extra: dict[str, str]):
        env = harness_env(identity, eval_home, eval_tmp, {**extra, "PYTHONNOUSERSITE": "1"})
        return supervise(
            cmd, identity=identity, cwd=cwd, env=env, log_path=eval_log,
            timeout_s=timeout, limits=opts.limits, watch=watch + [scratch],
        )  # fmt: skip

    start_eval = time.monotonic()
    if calls == 0:
        result = EvalResult(0.0, valid=False, detail="no model calls: nothing to train on")
    else:
        prepare_folders(identity, eval_home, eval_tmp, scratch)  # (scratch last: it closes 0700)
        context = EvalContext(workspace, scratch, run_command, eval_log)
        result = evaluate_with_retries(task, context, opts.eval_budget_s)
    tail = _log_tail(log_path)
    # an execution dropped for want of a score is dropped for the evaluator's reason: it goes first
    reasons = [r for r in ("" if result.valid else result.detail, reason) if r]
    if calls == 0:
        unstarted = START_FAILURE.search(tail)  # the limits wrapper could not exec the harness
        reasons = (
            [f"harness could not start {unstarted[1]}", unstarted[2].strip()]
            if unstarted
            else ["no model calls", *([reason] if reason else [])]
        )
    return ExecutionOutcome(
        execution_id=execution_id,
        task_id=task.task_id,
        exit_code=finished.exit_code,
        timed_out=finished.timed_out,
        duration_s=finished.duration_s + (time.monotonic() - start_eval),
        reward=float(result.reward) if result.valid else 0.0,
        valid=bool(result.valid),
        detail=("timed out; " if finished.timed_out else "") + result.detail,
        log_tail=tail,
        reason="; ".join(reasons),
        calls=calls,
    )


def _log_tail(path: Path, limit: int = 2000) -> str:
    """The last `limit` bytes of the harness log (it may have grown to gigabytes: only the tail is
    read), or "" when there is none."""
    try:
        return read_untrusted(path, limit, tail=True).decode(errors="replace")
    except (OSError, UntrustedFileError):
        return ""
