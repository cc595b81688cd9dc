"""Plan a step's executions and run one of them: the pieces the scheduler loop launches as Ray tasks.

Each execution gets its own API key from the proxy, so its calls are recorded under its own id,
and its own workspace under the run folder. Harness subprocesses are light (they wait on the
model), so their Ray tasks ask for no CPU and the cells keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.runner import Endpoint, ExecutionOutcome, harness_command, run_execution
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


def run_planned_execution(
    execution_id: str,
    task_set: str,
    task_id: str,
    endpoint: Endpoint,
    workspace: str,
    section: dict[str, Any],
) -> ExecutionOutcome:
    cfg = AgentSection(**section)
    task = next(t for t in get_task_set(task_set) if t.task_id == task_id)
    env = {"GYRE_TOY_TURNS": str(cfg.toy_turns), "GYRE_TOY_MAX_TOKENS": str(cfg.toy_max_tokens)}
    return run_execution(
        execution_id,
        task,
        endpoint,
        Path(workspace),
        command=harness_command(cfg.harness, task),
        timeout_s=cfg.timeout_s,
        env_extra=env,
    )
