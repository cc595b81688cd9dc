"""How a task's workspace is scored: the evaluator command (`CommandEvaluator`, run in the execution's
sandbox after the harness ends) and the three ways its result is read (`SCORES`): a pytest JUnit
report's share of passed tests, the last JSON `{"score": x}` line of its output, or its exit code.
Also the checks of a command's argv template and first item that the task file and the `command`
harness share (`template_problem`, `program_problem`). The task file's format: `gyre_ray.envs.taskfile`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from string import Formatter
from typing import Any

from gyre_ray.envs.base import EvalContext, EvalResult
from gyre_ray.envs.untrusted import UntrustedFileError, read_untrusted, remove_entries, write_fresh

SCORES = ("pytest", "json", "exit-code")
MAX_REPORT_BYTES = 64 << 20  # a JUnit report of tens of thousands of tests; the rest is not read
LOG_TAIL_BYTES = 65536
EVAL_PLACEHOLDERS = ("workspace", "hidden", "scratch", "report", "python")  # CommandEvaluator._command


def pytest_junit_share(report: Path) -> EvalResult:
    """Share of test cases in a JUnit XML report that passed (failures, errors, skips do not)."""
    try:
        root = ET.fromstring(read_untrusted(report, MAX_REPORT_BYTES))
    except (OSError, ET.ParseError) as exc:
        return EvalResult(0.0, valid=False, detail=f"no readable pytest report: {exc}")
    cases = list(root.iter("testcase"))
    if not cases:
        return EvalResult(0.0, valid=False, detail="the pytest report holds no test case")
    bad = sum(any(child.tag in ("failure", "error", "skipped") for child in case) for case in cases)
    passed = len(cases) - bad
    return EvalResult(passed / len(cases), detail=f"{passed}/{len(cases)} hidden tests passed")


def json_line_score(text: str) -> EvalResult:
    """The score on the last line of `text` that is a JSON object with a `score` key: valid when it is
    a number in [0, 1]; any other value there (NaN, 1.5, "0.5", true) makes the try invalid, never
    falls back to an earlier line."""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if not isinstance(value, dict) or "score" not in value:
            continue
        score = value["score"]
        if isinstance(score, (int, float)) and not isinstance(score, bool) and 0.0 <= score <= 1.0:
            return EvalResult(float(score), detail=str(value.get("detail", f"score {score}")))
        return EvalResult(
            0.0,
            valid=False,
            detail=f"the evaluator's last score line holds {shown(score)}, not a number in [0, 1]",
        )
    return EvalResult(0.0, valid=False, detail='the evaluator printed no JSON line {"score": x}')


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (a value from a user's file or an evaluator's output)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def program_problem(program: str, search: bool) -> str | None:
    """What is wrong with `program`, the first item of a command (the harness's or an evaluator's),
    as written: empty; a relative path with a slash (it would be resolved against each execution's
    workspace, not where the user wrote it); with `search`, a bare name not on PATH or a path that is
    no executable file. None when fine, or when it holds a placeholder (known only per execution)."""
    if not program:
        return "is empty: the first item names the program to run"
    if any(field is not None for _, field, _, _ in Formatter().parse(program)):
        return None
    if "/" not in program:
        if search and shutil.which(program) is None:
            return f"names no program on PATH ({os.environ.get('PATH', os.defpath)})"
        return None
    if not os.path.isabs(program):
        return (
            "is a relative path, which would be read from each execution's workspace: give an absolute "
            "path, or start it with a placeholder ({workspace}/... for a file the task seeds)"
        )
    if search and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        return "is not an executable file"
    return None


@dataclass(frozen=True)
class CommandEvaluator:
    """An evaluator command run in the execution's sandbox; see the module docstring."""

    score: str
    command: tuple[str, ...] | None
    hidden: Path | None
    timeout_s: float = 120.0
    test_timeout_s: float = 20.0
    needs_context = True

    def _command(self, workspace: Path, scratch: Path) -> list[str]:
        hidden = scratch / "hidden"
        if self.command is not None:
            values = {
                "workspace": str(workspace),
                "hidden": str(hidden),
                "scratch": str(scratch),
                "report": str(scratch / "report.xml"),
                "python": sys.executable,
            }
            return [part.format_map(values) for part in self.command]
        # a folder the uid owns; quoted, as pytest splits the value like a shell line
        write_fresh(scratch / "pytest.ini", f"[pytest]\npythonpath = {shlex.quote(str(workspace))}\n")
        cmd = [sys.executable, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
        cmd += ["-c", str(scratch / "pytest.ini"), "--rootdir", str(scratch)]
        cmd += ["--junitxml", str(scratch / "report.xml")]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += [f"--timeout={self.test_timeout_s:g}"]
        return [*cmd, str(hidden)]

    def __call__(self, workspace: Path, ctx: EvalContext) -> EvalResult:
        scratch = ctx.scratch
        remove_entries(*(scratch / name for name in ("hidden", "report.xml", "pytest.ini")), ctx.log)
        if self.hidden is not None:  # the source may be closed to the sandbox (make_private): open the copy
            shutil.copytree(self.hidden, scratch / "hidden")
            for dirpath, _dirs, filenames in os.walk(scratch / "hidden"):
                os.chmod(dirpath, 0o755)
                for name in filenames:  # readable; a script stays executable ({hidden}/judge.sh)
                    path = os.path.join(dirpath, name)
                    os.chmod(path, 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
        command = self._command(workspace, scratch)
        # a judge that cannot start gives no score (its exit code is none); a program in the workspace
        # is the agent's to keep: missing or not executable, it runs and scores what it gives
        unstartable = None
        if not (self.command and self.command[0].startswith("{workspace}")):
            unstartable = program_problem(command[0], search=True)
        if unstartable:
            return EvalResult(
                0.0, valid=False, detail=f"evaluator cannot start: {command[0]!r} {unstartable}"
            )
        finished = ctx.run(command, workspace, self.timeout_s, {})
        if finished.timed_out or finished.limit:
            why = "timed out" if finished.timed_out else f"passed its {finished.limit}"
            return EvalResult(0.0, valid=False, detail=f"evaluator {why}")
        try:
            tail = read_untrusted(ctx.log, LOG_TAIL_BYTES, tail=True)
            output = tail.decode(errors="replace")
        except FileNotFoundError:
            output = ""
        except UntrustedFileError as exc:
            return EvalResult(0.0, valid=False, detail=f"evaluator log: {exc}")
        if self.score == "pytest":
            return pytest_junit_share(scratch / "report.xml")
        if self.score == "json":
            return json_line_score(output)
        passed = finished.exit_code == 0
        return EvalResult(float(passed), detail=f"evaluator exited with code {finished.exit_code}")


def template_problem(items: list[str], allowed: tuple[str, ...]) -> str | None:
    """What is wrong with an argv template formatted with `str.format_map` over `allowed` names: an
    unknown name, attribute or index access, a conversion or format spec, a lone brace; None if fine."""
    names = ", ".join("{" + name + "}" for name in allowed)
    for index, item in enumerate(items):
        try:
            fields = [(f, c, s) for _, f, s, c in Formatter().parse(item) if f is not None]
        except ValueError as exc:
            return f"item {index} {item!r}: {exc} (write a literal brace doubled: {{{{ or }}}})"
        for name, conversion, spec in fields:
            written = (
                "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            )
            if name not in allowed or conversion or spec:
                return (
                    f"item {index} {item!r}: placeholder {written} is not allowed; the allowed ones are "
                    f"{names}, each bare (no attribute, index, !conversion or :format), and "
                    "{{ or }} for a literal brace"
                )
    return None
