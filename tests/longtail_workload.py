"""Test-only runner of the `longtail` task set's executions in-process, for real cells on a small machine.

`LongTailExecutor` has `run_planned_execution`'s signature, so the scheduler launches it as each
execution's Ray task. An execution lasts what the `longtail` task set says
(`gyre_ray.envs.longtail.execution_seconds`: the simulator's `nl2repo` preset, one hour scaled to
`hour_s` seconds, capped at the timeout, then timed out), spent in tool sleeps between short model
calls through the proxy, each call re-sending the conversation so far (a growing main path); its
answer goes to answer.txt and the toy task's evaluator scores it. Why not the task set itself
(`agents.task_set=longtail:S`, the toy harness in a subprocess)? On this shared 2-core machine the
harness's own model calls (8 calls, ~1,500 prompt tokens) take 16-20 s per execution at load 24, and
at `longtail:4` every execution timed out before its first call: model time, not tool time, would set
the durations. Here one call of `max_tokens` tokens per `tool_s` sleep keeps tool time dominant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LongTailExecutor:
    """One execution of the long-tailed workload (picklable; Ray ships it by value)."""

    hour_s: float = 10.0  # seconds of this run standing for one hour of the preset
    tool_s: float = 0.8  # one tool call (sleep) between model calls
    max_tokens: int = 8
    seed: int = 0
    # tasks whose executions write no answer.txt, so every one scores 0: a group of equal rewards by
    # construction (a random tiny model writes a digit now and then, so "digits" is flat only by chance)
    unanswered_tasks: tuple[str, ...] = ()

    def duration_s(self, execution_id: str) -> tuple[float, bool]:
        """(seconds, timed out) of an execution `[<run tag>.]s<step>-<task>-<g>`: the `longtail` task set's
        duration for that workspace name (the run tag does not count), capped at the scaled timeout."""
        from gyre_ray.envs.longtail import TIMEOUT_HOURS, execution_seconds, schedule_for

        seconds = execution_seconds(schedule_for(self.seed, self.hour_s), execution_id)
        timeout = TIMEOUT_HOURS * self.hour_s
        return min(seconds, timeout), seconds >= timeout

    def __call__(
        self,
        execution_id: str,
        task_set: str,
        task_id: str,
        endpoint: Any,
        workspace: str,
        section: dict[str, Any],
        run_seed: int = 0,  # the fake draws from its own seed
    ) -> Any:
        import httpx

        from gyre_ray.agents.runner import ExecutionOutcome
        from gyre_ray.envs.base import get_task_set

        task = next(t for t in get_task_set(task_set) if t.task_id == task_id)
        folder = Path(workspace)
        task.seed_workspace(folder)
        duration, timed_out = self.duration_s(execution_id)
        started = time.monotonic()
        messages = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": task.prompt},
        ]
        answer: list[str] = []
        headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        with httpx.Client(base_url=endpoint.base_url, headers=headers, timeout=120.0) as client:
            while True:
                reply = client.post(
                    "/v1/chat/completions",
                    json={"model": "policy", "messages": messages, "max_tokens": self.max_tokens},
                )
                reply.raise_for_status()
                text = reply.json()["choices"][0]["message"]["content"] or ""
                answer.append(text)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "tool: ok"}]
                left = duration - (time.monotonic() - started)
                if left <= 0:
                    break
                time.sleep(min(self.tool_s, left))  # the tool call (a test run, a build)
                if time.monotonic() - started >= duration:
                    break
        if task_id not in self.unanswered_tasks:
            (folder / "answer.txt").write_text(" ".join(answer))
        result = task.evaluate(folder)
        return ExecutionOutcome(
            execution_id=execution_id,
            task_id=task_id,
            exit_code=None if timed_out else 0,
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            reward=float(result.reward),
            valid=bool(result.valid),
            detail=("timed out; " if timed_out else "") + result.detail,
            log_tail="",
        )


def register_by_value(module_name: str) -> None:
    """Let Ray workers unpickle a tests/ module's classes (tests/ is not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])


def ship_by_value() -> None:
    """Ship this module's classes to Ray workers by value."""
    register_by_value(__name__)
