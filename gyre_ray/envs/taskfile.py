"""Task sets from files (`agents.task_set=PATH`): JSONL (one task per line) or YAML (a list, or a
mapping with `tasks:`). Relative paths are read from the task file's folder. Fields of a task:

    id: slugify                    # required, unique; A-Za-z0-9_.- only, at most 96 characters
    prompt: "Build ..."            # or prompt_file: spec.md (one of the two)
    files: {README.md: "..."}      # seed files written into the workspace
    seed_dir: seeds/slugify        # a folder copied into the workspace
    git: https://host/repo.git     # or a local repository: cloned into the workspace (git_rev: a branch/tag)
    hidden: hidden/slugify         # tests the agent never sees: copied in for the evaluator only
    time_limit_s: 300              # the harness's wall time (default: agents.timeout_s)
    evaluator:
      score: pytest                # pytest: share of hidden tests passed (JUnit report);
                                   # json: last stdout line {"score": x} with 0 <= x <= 1;
                                   # exit-code: 1.0 when the command exits 0, else 0.0
      command: [...]               # default for pytest: the hidden tests under pytest
      timeout_s: 120               # one evaluator try
      test_timeout_s: 20           # pytest only: one test's limit (pytest-timeout)

The evaluator command runs in the execution's sandbox (its uid and limits, without its API key),
in the workspace, after the harness has ended (also after a timeout: partial credit). Its items
may hold `{workspace}`, `{hidden}`, `{scratch}`, `{report}` and `{python}`. A try that yields no
score (killed, no report, no JSON line) is repeated within `agents.eval_budget_s`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gyre_ray.envs.base import EvalContext, EvalResult, Task
from gyre_ray.envs.untrusted import UntrustedFileError, read_untrusted, write_fresh

SCORES = ("pytest", "json", "exit-code")
TASK_KEYS = {"id", "prompt", "prompt_file", "files", "seed_dir", "git", "git_rev", "hidden", "time_limit_s"}
TASK_KEYS |= {"evaluator"}
EVAL_KEYS = {"score", "command", "timeout_s", "test_timeout_s"}
MAX_REPORT_BYTES = 64 << 20  # a JUnit report of tens of thousands of tests; the rest is not read
LOG_TAIL_BYTES = 65536


class TaskFileError(ValueError):
    """A task file that does not follow the documented format."""


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
    """The last line of `text` that is a JSON object with a numeric `score` in [0, 1]."""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        score = value.get("score") if isinstance(value, dict) else None
        if isinstance(score, (int, float)) and not isinstance(score, bool) and 0.0 <= score <= 1.0:
            return EvalResult(float(score), detail=str(value.get("detail", f"score {score}")))
    return EvalResult(0.0, valid=False, detail='the evaluator printed no {"score": x} line')


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
        write_fresh(scratch / "pytest.ini", f"[pytest]\npythonpath = {workspace}\n")  # a folder the uid owns
        cmd = [sys.executable, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
        cmd += ["-c", str(scratch / "pytest.ini"), "--rootdir", str(scratch)]
        cmd += ["--junitxml", str(scratch / "report.xml")]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += [f"--timeout={self.test_timeout_s:g}"]
        return [*cmd, str(hidden)]

    def __call__(self, workspace: Path, ctx: EvalContext) -> EvalResult:
        scratch = ctx.scratch
        for stale in ("hidden", "report.xml", "evaluator.log", "pytest.ini"):  # never through a link
            target = scratch / stale
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        if self.hidden is not None:  # the source may be closed to the sandbox (make_private): open the copy
            shutil.copytree(self.hidden, scratch / "hidden")
            for dirpath, _dirs, filenames in os.walk(scratch / "hidden"):
                os.chmod(dirpath, 0o755)
                for name in filenames:
                    os.chmod(os.path.join(dirpath, name), 0o644)
        finished = ctx.run(self._command(workspace, scratch), workspace, self.timeout_s, {})
        if finished.timed_out or finished.limit:
            why = "timed out" if finished.timed_out else f"passed its {finished.limit}"
            return EvalResult(0.0, valid=False, detail=f"evaluator {why}")
        try:
            tail = read_untrusted(scratch / "evaluator.log", LOG_TAIL_BYTES, tail=True)
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


def _path(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise TaskFileError(f"{where} must be a non-empty path string")
    path = (base / value).resolve()
    if not path.exists():
        raise TaskFileError(f"{where}: {path} does not exist")
    return path


# Execution ids are f"s{step}-{id}-{g}" (`gyre_ray.agents.launch.plan_step`) and f"eval{step}-{id}-{i}"
# (`gyre_ray.evaluation.plan_round`); the record store takes [A-Za-z0-9_.-], at most 128 characters
# (`gyre_ray.proxy.store.EXECUTION_ID`). 32 of them are left to the wrapper: a 12-digit step and a
# 12-digit index still fit.
EXECUTION_ID_MAX = 128
TASK_ID_MAX = EXECUTION_ID_MAX - 32
TASK_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
EVAL_PLACEHOLDERS = ("workspace", "hidden", "scratch", "report", "python")  # CommandEvaluator._command


def _check_task_id(task_id: Any, where: str) -> str:
    if not isinstance(task_id, str) or not task_id:
        raise TaskFileError(f"{where}: id must be a non-empty string")
    bad = sorted(set(task_id) - TASK_ID_CHARS)
    if bad or len(task_id) > TASK_ID_MAX:
        why = f"holds {''.join(bad)!r}" if bad else f"has {len(task_id)} characters"
        raise TaskFileError(
            f"{where}: id {task_id[: TASK_ID_MAX + 8]!r} {why}; an id may hold only letters, digits, "
            f"'_', '.' and '-' (A-Za-z0-9_.-), at most {TASK_ID_MAX} characters"
        )
    return task_id


def template_problem(items: list[str], allowed: tuple[str, ...]) -> str | None:
    """What is wrong with an argv template formatted with `str.format_map` over `allowed` names: an
    unknown name, attribute or index access, a conversion or format spec, a lone brace; None if fine."""
    from string import Formatter

    names = ", ".join("{" + name + "}" for name in allowed)
    for index, item in enumerate(items):
        try:
            fields = [(f, c, s) for _, f, s, c in Formatter().parse(item) if f is not None]
        except ValueError as exc:
            return f"item {index} {item!r}: {exc} (write a literal brace doubled: {{{{ or }}}})"
        for name, conversion, spec in fields:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            if name not in allowed or conversion or spec:
                return (
                    f"item {index} {item!r}: placeholder {shown} is not allowed; the allowed ones are "
                    f"{names}, each bare (no attribute, index, !conversion or :format), and "
                    "{{ or }} for a literal brace"
                )
    return None


def parse_task(raw: Any, base: Path, where: str) -> Task:
    """One task from its mapping (`base`: the task file's folder)."""
    if not isinstance(raw, dict):
        raise TaskFileError(f"{where}: a task must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - TASK_KEYS
    if unknown:
        raise TaskFileError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(TASK_KEYS)}")
    task_id = _check_task_id(raw.get("id"), where)
    where = f"{where} ({task_id})"
    if ("prompt" in raw) == ("prompt_file" in raw):
        raise TaskFileError(f"{where}: give exactly one of prompt and prompt_file")
    prompt = raw["prompt"] if "prompt" in raw else _path(base, raw["prompt_file"], where).read_text()
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskFileError(f"{where}: the prompt is empty")
    files = raw.get("files") or {}
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise TaskFileError(f"{where}: files must map relative paths to text")
    spec = raw.get("evaluator", {})  # left out: the pytest default over the hidden tests
    if not isinstance(spec, dict) or set(spec) - EVAL_KEYS:
        raise TaskFileError(f"{where}: evaluator must be a mapping with keys from {sorted(EVAL_KEYS)}")
    score = spec.get("score", "pytest")
    if score not in SCORES:
        raise TaskFileError(f"{where}: evaluator.score must be one of {', '.join(SCORES)}")
    command = spec.get("command")
    if command is not None and (
        not isinstance(command, list) or not all(isinstance(c, str) for c in command)
    ):
        raise TaskFileError(f"{where}: evaluator.command must be a list of strings")
    problem = template_problem(command, EVAL_PLACEHOLDERS) if command is not None else None
    if problem:
        raise TaskFileError(f"{where}: evaluator.command {problem}")
    if command is None and score != "pytest":
        raise TaskFileError(f"{where}: evaluator.command is required for score {score!r}")
    hidden = _path(base, raw["hidden"], f"{where}: hidden") if "hidden" in raw else None
    if command is None and hidden is None:
        raise TaskFileError(f"{where}: score pytest without a command needs hidden tests")
    limits = {k: raw.get(k) or spec.get(k) for k in ("time_limit_s", "timeout_s", "test_timeout_s")}
    for key, value in limits.items():
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise TaskFileError(f"{where}: {key} must be a positive number")
    evaluator = CommandEvaluator(
        score, tuple(command) if command else None, hidden,
        float(limits["timeout_s"] or 120.0), float(limits["test_timeout_s"] or 20.0),
    )  # fmt: skip
    git = raw.get("git")
    if git is not None and not isinstance(git, str):
        raise TaskFileError(f"{where}: git must be a repository URL or path")
    if git and (base / git).exists():
        git = str((base / git).resolve())
    seed_dir = _path(base, raw["seed_dir"], f"{where}: seed_dir") if "seed_dir" in raw else None
    return Task(
        task_id, prompt, evaluator, dict(files), limits["time_limit_s"], seed_dir, git, raw.get("git_rev")
    )


def load_task_file(path: Path) -> list[Task]:
    """The tasks of a .jsonl or .yaml/.yml task file (errors name the file, line or index)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise TaskFileError(f"task file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".jsonl":
        raws = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raws.append((json.loads(line), f"{path.name}:{number}"))
                except ValueError as exc:
                    raise TaskFileError(f"{path.name}:{number}: not JSON: {exc}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TaskFileError(f"{path.name}: not YAML: {exc}") from None
        data = data.get("tasks") if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise TaskFileError(f"{path.name}: expected a list of tasks (or a mapping with 'tasks')")
        raws = [(raw, f"{path.name}: task {i}") for i, raw in enumerate(data)]
    tasks = [parse_task(raw, path.parent, where) for raw, where in raws]
    if not tasks:
        raise TaskFileError(f"{path.name}: no tasks")
    ids = [t.task_id for t in tasks]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate:
        raise TaskFileError(f"{path.name}: task id {duplicate!r} appears twice")
    return tasks
