"""The shipped mini NL2Repo set: build a small Python package from its spec, scored by hidden tests.

Four tasks (`slugkit`, `romankit`, `rlekit`, `rpnkit`) in `nl2repo_mini/tasks.yaml`, a task file of
the documented format (docs/harnesses.md): the prompt is the spec, the hidden pytest tests are
copied in only for the evaluator (the agent never sees them), and the score is the share of them
that pass, also for a workspace left by a timed-out run. Use it as `agents.task_set=nl2repo-mini`.
"""

from __future__ import annotations

from pathlib import Path


def nl2repo_mini_path() -> Path:
    """The task file of the shipped set."""
    return Path(__file__).resolve().parent / "nl2repo_mini" / "tasks.yaml"
