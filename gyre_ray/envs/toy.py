"""The toy task set: small text-writing tasks whose score is graded, so a random tiny model's
executions differ in reward and group-normalised advantages carry signal.

Each task asks the agent to write `answer.txt`; the evaluator scores how well it covers and
concentrates on the task's target characters (partial credit by construction), and invalidates
the execution when its answer cannot be read.
"""

from __future__ import annotations

from pathlib import Path

from gyre_ray.envs.base import EvalResult, Evaluator, Task
from gyre_ray.envs.untrusted import UntrustedFileError, read_untrusted

ANSWER_FILE = "answer.txt"
MAX_ANSWER_BYTES = 1 << 20  # read of an answer; the toy tasks ask for a few hundred characters


def read_answer(workspace: Path) -> str | EvalResult:
    """The text of the workspace's answer.txt (its first MAX_ANSWER_BYTES), or the result to return
    without one: reward 0 when it is missing or not a regular file (a link is never followed), an
    invalid evaluation when it cannot be read."""
    try:  # the agent's file: never through a link, at most MAX_ANSWER_BYTES
        return read_untrusted(workspace / ANSWER_FILE, MAX_ANSWER_BYTES).decode(errors="replace")
    except FileNotFoundError:
        return EvalResult(0.0, detail="no answer.txt: reward 0")
    except UntrustedFileError as exc:  # a link or a folder is the agent's doing: scored, not dropped
        return EvalResult(0.0, detail=f"{exc}: reward 0")
    except OSError as exc:
        return EvalResult(0.0, valid=False, detail=f"answer.txt unreadable: {exc}")


def char_coverage_evaluator(targets: str) -> Evaluator:
    """Reward = half for coverage (share of distinct target characters present in answer.txt) and half
    for density (share of the answer's characters that are target characters): graded, so executions
    of one task differ and their group-normalised advantages carry signal."""
    wanted = set(targets)

    def evaluate(workspace: Path) -> EvalResult:
        text = read_answer(workspace)
        if isinstance(text, EvalResult):
            return text
        chars = [c for c in text if not c.isspace()]
        coverage = len(wanted & set(chars)) / len(wanted)
        density = sum(c in wanted for c in chars) / len(chars) if chars else 0.0
        return EvalResult(
            0.5 * coverage + 0.5 * density, detail=f"coverage {coverage:.2f}, density {density:.3f}"
        )

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
