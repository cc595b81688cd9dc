"""Test-only long-tailed agent workload for real cells (until `agents.task_set=longtail` lands).

`LongTailExecutor` has `run_planned_execution`'s signature, so the scheduler launches it as each
execution's Ray task. An execution lasts D seconds, D following the simulator's `nl2repo` preset
scaled down in time (`hour_s` seconds stand for one hour): log D ~ mu + sigma (sqrt(rho) z_task +
sqrt(1 - rho) z_exec), capped at the timeout (then it is timed out). It spends that time mostly in
tool calls (sleeps standing for test runs and builds) between short model calls through the proxy,
each call re-sending the conversation so far (a growing main path); its answer (the model's text)
goes to answer.txt and the toy task's evaluator scores it. Durations are a pure function of the
execution id and `seed`, so every policy sees the same workload.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# nl2repo (gyre_ray/sim/presets.py): median 0.4 h, sigma 0.55 log hours, rho 0.6, timeout 1.5 h
NL2REPO = {"mu_log_hours": -0.916, "sigma_log_hours": 0.55, "rho": 0.6, "timeout_hours": 1.5}


def _normal(*key: Any) -> float:
    return random.Random(zlib.crc32(repr(key).encode())).gauss(0.0, 1.0)


@dataclass
class LongTailExecutor:
    """One execution of the long-tailed workload (picklable; Ray ships it by value)."""

    hour_s: float = 10.0  # seconds of this run standing for one hour of the preset
    tool_s: float = 0.8  # one tool call (sleep) between model calls
    max_tokens: int = 8
    seed: int = 0
    mu_log_hours: float = NL2REPO["mu_log_hours"]
    sigma_log_hours: float = NL2REPO["sigma_log_hours"]
    rho: float = NL2REPO["rho"]
    timeout_hours: float = NL2REPO["timeout_hours"]

    def duration_s(self, execution_id: str) -> tuple[float, bool]:
        """(seconds, timed out) of an execution `[<run tag>.]s<step>-<task>-<g>` (its task and step share
        z_task; the run tag does not count, so every run of a benchmark sees the same durations)."""
        execution_id = execution_id.rsplit(".", 1)[-1]
        group = execution_id.rsplit("-", 1)[0]
        z = math.sqrt(self.rho) * _normal(self.seed, group) + math.sqrt(1 - self.rho) * _normal(
            self.seed, execution_id
        )
        hours = math.exp(self.mu_log_hours + self.sigma_log_hours * z)
        timed_out = hours >= self.timeout_hours
        return min(hours, self.timeout_hours) * self.hour_s, timed_out

    def __call__(
        self,
        execution_id: str,
        task_set: str,
        task_id: str,
        endpoint: Any,
        workspace: str,
        section: dict[str, Any],
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


def ship_by_value() -> None:
    """Let Ray workers unpickle this module's classes (tests/ is not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
