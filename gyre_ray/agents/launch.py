"""Plan a step's executions and run one of them: the pieces the scheduler loop launches as Ray tasks.

Each execution gets its own API key from the proxy, so its calls are recorded under its own id,
and its own workspace under the run folder, in its own sandbox (see `gyre_ray.agents.sandbox`).
Harness subprocesses are light (they wait on the model), so their Ray tasks ask for no CPU and the
cells keep theirs. `run_planned_execution` never raises: whatever goes wrong becomes a dropped
execution with its reason.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.harnesses import build_harness
from gyre_ray.agents.runner import Endpoint, ExecutionOutcome, run_execution
from gyre_ray.agents.sandbox import (
    Limits,
    close_hidden_tests,
    job_workspaces,
    own_uids,
    protect_job_folders,
    protect_ray_credentials,
    secure_workspace_root,
)
from gyre_ray.envs.base import Task, get_task_set


@dataclass(frozen=True)
class PlannedExecution:
    """One execution of a step: its id, its task and the group (task) whose rewards it is compared with."""

    execution_id: str
    task: Task
    group: str


def plan_step(step: int, tasks: list[Task], tasks_per_step: int, group_size: int) -> list[PlannedExecution]:
    """`tasks_per_step` tasks (cycling through the set) x `group_size` executions each."""
    if not tasks:
        raise ValueError("the task set is empty")
    chosen = [tasks[(step * tasks_per_step + i) % len(tasks)] for i in range(tasks_per_step)]
    return [
        PlannedExecution(f"s{step}-{task.task_id}-{g}", task, f"s{step}-{task.task_id}")
        for task in chosen
        for g in range(group_size)
    ]


def limits_of(cfg: AgentSection) -> Limits:
    return Limits(cfg.max_processes, cfg.max_memory_mb, cfg.max_file_mb, cfg.max_disk_mb)


def runs_as_root(cfg: AgentSection) -> bool:
    """Whether the harness will run with uid 0 (the job is root and has no uid of its own to give it)."""
    return os.geteuid() == 0 and not own_uids(cfg.isolation)


def run_planned_execution(
    execution_id: str,
    task_set: str,
    task_id: str,
    endpoint: Endpoint,
    workspace: str,
    section: dict[str, Any],
    run_seed: int = 0,
) -> ExecutionOutcome:
    """Run one planned execution in the job's layout (`workspace` = <run>/workspaces/<id>).

    `run_seed` (`run.seed`) reaches the harness as GYRE_RUN_SEED: the toy harness draws its request
    seeds and a `longtail` task's tool sleeps from it and the execution's name."""
    start = time.monotonic()
    try:
        cfg = AgentSection(**section)
        tasks = get_task_set(task_set)
        task = next(t for t in tasks if t.task_id == task_id)
        path = Path(workspace)
        if cfg.isolation != "none":
            if cfg.workspace_root is not None:
                secure_workspace_root(Path(cfg.workspace_root))
            protect_job_folders(job_workspaces(path))
            protect_ray_credentials()  # on every node that runs executions (chmods: cheap)
            if own_uids(cfg.isolation):  # close every task's tests, not only this one's
                close_hidden_tests([h for t in tasks if (h := getattr(t.evaluate, "hidden", None))])
        home = path.parent / f"{path.name}.home"
        spec = build_harness(
            cfg.harness, task.prompt, base_url=endpoint.base_url, workspace=path, home=home,
            as_root=runs_as_root(cfg), template=cfg.command, extra_args=cfg.harness_args,
        )  # fmt: skip
        toy = {
            "GYRE_TOY_TURNS": str(cfg.toy_turns),
            "GYRE_TOY_MAX_TOKENS": str(cfg.toy_max_tokens),
            "GYRE_TOY_TOP_P": str(cfg.toy_top_p),
        }  # the toy harness's knobs: no other harness reads them
        env = {**(toy if cfg.harness == "toy" else {}), "GYRE_RUN_SEED": str(run_seed), **spec.env}
        return run_execution(
            execution_id, task, endpoint, path, command=spec.command,
            timeout_s=task.time_limit_s or cfg.timeout_s, env_extra=env, isolation=cfg.isolation,
            limits=limits_of(cfg), eval_budget_s=cfg.eval_budget_s, passthrough=tuple(cfg.env_passthrough),
            home_files=spec.home_files, require_calls=True,
        )  # fmt: skip
    except Exception as exc:  # a broken execution is dropped with its reason, never a crashed job
        return ExecutionOutcome(
            execution_id=execution_id, task_id=task_id, exit_code=None, timed_out=False,
            duration_s=time.monotonic() - start, reward=0.0, valid=False,
            detail=traceback.format_exc(limit=3)[-1000:], log_tail="",
            reason=f"execution could not run: {type(exc).__name__}: {exc}",
        )  # fmt: skip
