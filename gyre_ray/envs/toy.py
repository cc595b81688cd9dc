"""The toy task set: small text-writing tasks whose score is graded, so a random tiny model's
executions differ in reward and group-normalised advantages carry signal.

Each task asks the agent to write `answer.txt`; the evaluator scores the fraction of the
task's target characters present in it (partial credit by construction), and invalidates the
execution when the workspace has no readable answer at all.
"""

from __future__ import annotations

from pathlib import Path

from gyre_ray.envs.base import EvalResult, Task

ANSWER_FILE = "answer.txt"


def char_coverage_evaluator(targets: str) -> callable:
    """Reward = share of distinct characters of `targets` that appear in answer.txt."""
    wanted = set(targets)

    def evaluate(workspace: Path) -> EvalResult:
        path = workspace / ANSWER_FILE
        if not path.is_file():
            return EvalResult(0.0, valid=True, detail="no answer.txt: reward 0")
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            return EvalResult(0.0, valid=False, detail=f"answer.txt unreadable: {exc}")
        hit = len(wanted & set(text))
        return EvalResult(hit / len(wanted), detail=f"{hit}/{len(wanted)} target characters")

    return evaluate


_TOY_SPECS = (
    ("vowels", "Write a short sentence that uses every vowel.", "aeiou"),
    ("digits", "List the digits from zero to nine.", "0123456789"),
    ("brackets", "Write a Python list of pairs, e.g. [(1, 2)].", "[](),"),
    ("greeting", "Write a friendly greeting for the README.", "Hello!"),
)


def toy_tasks() -> list[Task]:
    """The built-in toy tasks."""
    return [
        Task(task_id=name, prompt=prompt, evaluate=char_coverage_evaluator(targets))
        for name, prompt, targets in _TOY_SPECS
    ]
