"""Tasks and evaluators.

A `Task` is what one execution is asked to do: a prompt, files to seed the workspace with, and an
evaluator that scores the workspace the execution leaves behind. Evaluation runs on the workspace
also after a timeout, so a run that did half the work gets partial credit; an evaluation that fails
to produce a score marks the execution invalid (it is then dropped from training).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EvalResult:
    """A workspace's score: reward in [0, 1], valid=False when no score could be had."""

    reward: float
    valid: bool = True
    detail: str = ""


Evaluator = Callable[[Path], EvalResult]


@dataclass(frozen=True)
class EvalContext:
    """What a command evaluator gets besides the workspace: a private scratch folder (hidden tests,
    reports), `run(command, cwd, timeout_s, env)`, which runs a command in the execution's sandbox
    (its uid and limits) and returns `supervise.Finished`, and `log`, where that command's output
    goes: a file in the job's folder, which the execution's uid cannot replace (its scratch folder
    it can: a judge's output read back from there could be the agent's forgery)."""

    workspace: Path
    scratch: Path
    run: Callable[[list[str], Path, float, dict[str, str]], Any]
    log: Path


@dataclass(frozen=True)
class Task:
    """One task: an id, the instruction given to the agent, workspace seed files and an evaluator."""

    task_id: str
    prompt: str
    evaluate: Evaluator
    files: dict[str, str] = field(default_factory=dict)
    time_limit_s: float | None = None  # overrides agents.timeout_s when set
    seed_dir: Path | None = None  # a folder copied into the workspace first
    git: str | None = None  # a repository cloned into the workspace first
    git_rev: str | None = None

    def seed_workspace(self, workspace: Path) -> None:
        """Write the task's seed files into a fresh workspace folder.

        A clone never hard-links (`--no-hardlinks`): git's local clone hard-links the source's object
        files, so handing the workspace to the execution's uid would give it the source repository's
        (and every other workspace's) objects to rewrite. A local clone keeps its whole history (git
        ignores `--depth` there); a URL's is one commit deep."""
        workspace.mkdir(parents=True, exist_ok=True)
        if self.git:
            import subprocess

            branch = ["--branch", self.git_rev] if self.git_rev else []
            cmd = ["git", "clone", "--quiet", "--no-hardlinks", "--depth", "1", *branch, "--", self.git]
            done = subprocess.run(
                [*cmd, str(workspace)], capture_output=True, text=True, timeout=600, check=False
            )
            if done.returncode != 0:
                why = done.stderr.strip()[-500:] or f"exit code {done.returncode}"
                raise RuntimeError(f"task {self.task_id}: git clone of {self.git} failed: {why}")
        if self.seed_dir is not None:
            import shutil

            shutil.copytree(self.seed_dir, workspace, dirs_exist_ok=True, symlinks=True)
        for rel, text in self.files.items():
            target = (workspace / rel).resolve()
            if workspace.resolve() not in target.parents:
                raise ValueError(f"task {self.task_id}: seed file {rel!r} escapes the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")


def evaluate_with_retries(task: Task, ctx: EvalContext, budget_s: float) -> EvalResult:
    """Score the workspace; while the evaluator yields no valid score, try again until `budget_s` is
    spent (one try at least). An evaluator that raises counts as a failed try."""
    deadline = time.monotonic() + budget_s
    tries, result = 0, EvalResult(0.0, valid=False, detail="not evaluated")
    while True:
        tries += 1
        try:
            if getattr(task.evaluate, "needs_context", False):
                result = task.evaluate(ctx.workspace, ctx)  # type: ignore[call-arg]
            else:
                result = task.evaluate(ctx.workspace)
        except Exception as exc:  # a crashed evaluator is an invalid try, not a crashed job
            result = EvalResult(0.0, valid=False, detail=f"evaluator failed: {type(exc).__name__}: {exc}")
        if result.valid or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if tries > 1:
        note = f"after {tries} evaluator tries"
        result = EvalResult(result.reward, result.valid, f"{result.detail} ({note})".strip())
    return result


NAMED_SETS = ("toy", "words", "nl2repo-mini", "longtail")


def get_task_set(name: str) -> list[Task]:
    """The tasks of a named set (`toy`: the CPU demo; `words`: small answer space, for the warm-up job;
    `nl2repo-mini`: build-a-package tasks scored by hidden tests; `longtail`: the toy tasks with nl2repo-like durations) or of a task file (a path ending
    in .jsonl, .yaml or .yml; see docs/harnesses.md)."""
    if name == "toy":
        from gyre_ray.envs.toy import toy_tasks

        return toy_tasks()
    if name == "words":
        from gyre_ray.envs.words import word_tasks

        return word_tasks()
    if name == "longtail" or name.startswith("longtail:"):
        from gyre_ray.envs.longtail import longtail_tasks, parse_scale

        return longtail_tasks(seconds_per_hour=parse_scale(name) or 0.0)
    if name == "nl2repo-mini":
        from gyre_ray.envs.nl2repo import nl2repo_mini_path

        name = str(nl2repo_mini_path())
    if name.endswith((".jsonl", ".yaml", ".yml")):
        from gyre_ray.envs.taskfile import load_task_file

        return load_task_file(Path(name))
    raise ValueError(f"unknown task set {name!r}; known: {', '.join(NAMED_SETS)}, or a .jsonl/.yaml file")
