"""Tasks and evaluators.

A `Task` is what one execution is asked to do: a prompt, files to seed the workspace with, and an
evaluator that scores the workspace the execution leaves behind. Evaluation runs on the workspace
also after a timeout, so a run that did half the work gets partial credit; an evaluation that fails
to produce a score marks the execution invalid (it is then dropped from training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EvalResult:
    """A workspace's score: reward in [0, 1], valid=False when no score could be had."""

    reward: float
    valid: bool = True
    detail: str = ""


Evaluator = Callable[[Path], EvalResult]


@dataclass(frozen=True)
class Task:
    """One task: an id, the instruction given to the agent, workspace seed files and an evaluator."""

    task_id: str
    prompt: str
    evaluate: Evaluator
    files: dict[str, str] = field(default_factory=dict)

    def seed_workspace(self, workspace: Path) -> None:
        """Write the task's seed files into a fresh workspace folder."""
        workspace.mkdir(parents=True, exist_ok=True)
        for rel, text in self.files.items():
            target = (workspace / rel).resolve()
            if workspace.resolve() not in target.parents:
                raise ValueError(f"task {self.task_id}: seed file {rel!r} escapes the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


def get_task_set(name: str) -> list[Task]:
    """The tasks of a named set (`toy` is the CPU demo set, `longtail` the same with nl2repo-like durations)."""
    if name == "toy":
        from gyre_ray.envs.toy import toy_tasks

        return toy_tasks()
    if name == "longtail":
        from gyre_ray.envs.longtail import longtail_tasks

        return longtail_tasks()
    raise ValueError(f"unknown task set {name!r}; known: toy, longtail")
