"""Launch a step's executions as Ray tasks: register each with the proxy, run its harness, collect outcomes.

Each execution gets its own API key from the proxy, so its calls are recorded under its own id,
and its own workspace under the run folder. Harness subprocesses are light (they wait on the
model), so the Ray tasks ask for no CPU and the rollout cells keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.runner import Endpoint, ExecutionOutcome, harness_command, run_execution
from gyre_ray.envs.base import Task, get_task_set
from gyre_ray.observability.progress import Progress


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


def _run_one(
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


def run_step_executions(
    proxy: Any, planned: list[PlannedExecution], section: AgentSection, workspaces: Path
) -> list[ExecutionOutcome]:
    """Run every planned execution (at most `max_parallel` at once) and return their outcomes in plan order."""
    import ray

    remote = ray.remote(num_cpus=0)(_run_one)
    pending: dict[Any, int] = {}
    outcomes: list[ExecutionOutcome | None] = [None] * len(planned)
    queue = list(enumerate(planned))
    with Progress("rollout", total=len(planned)) as progress:
        while queue or pending:
            while queue and len(pending) < section.max_parallel:
                index, item = queue.pop(0)
                key = proxy.register_execution(item.execution_id, {"task_id": item.task.task_id})["api_key"]
                ref = remote.remote(
                    item.execution_id,
                    section.task_set,
                    item.task.task_id,
                    Endpoint(proxy.base_url, key),
                    str(workspaces / item.execution_id),
                    section.model_dump(),
                )
                pending[ref] = index
            done, _ = ray.wait(list(pending), num_returns=1, timeout=5.0)
            for ref in done:
                index = pending.pop(ref)
                outcomes[index] = ray.get(ref)
            finished = sum(o is not None for o in outcomes)
            progress.update(finished, note=f"{len(pending)} running")
    return [o for o in outcomes if o is not None]
