"""Task sets from files (`agents.task_set=PATH`): JSONL (one task per line) or YAML (a list, or a
mapping with `tasks:`; other top-level keys are there for anchors and merge keys, and are ignored). Relative paths are read from the task file's folder. Fields of a task:

    id: slugify                    # required, unique; A-Za-z0-9_.- only, at most 96 characters
    prompt: "Build ..."            # or prompt_file: spec.md (one of the two; UTF-8, at most 120 KiB)
    files: {README.md: "..."}      # seed files written into the workspace (relative paths, no '..')
    seed_dir: seeds/slugify        # a folder copied into the workspace (links copied as links)
    git: https://host/repo.git     # or a local repository: cloned into the workspace (git_rev: a branch/tag)
    hidden: hidden/slugify         # tests the agent never sees: copied in for the evaluator only
    time_limit_s: 300              # the harness's wall time (default: agents.timeout_s)
    evaluator:
      score: pytest                # pytest: share of hidden tests passed (JUnit report at {report});
                                   # json: the last output line that is a JSON object with a "score"
                                   # key, whose value must be a number in [0, 1];
                                   # exit-code: 1.0 when the command exits 0, else 0.0
      command: [...]               # default for pytest: the hidden tests under pytest
      timeout_s: 120               # one evaluator try
      test_timeout_s: 20           # the default pytest command only: one test's limit (pytest-timeout)

Everything is checked when the file is loaded (`gyre-ray config` loads it), and a mistake is a
`TaskFileError` naming the file, the line (JSONL) or task index, the task and the key: unknown or
repeated keys, keys given without a value, wrong types, paths that do not exist or escape the
workspace, a local `git` repository git cannot read or that lacks `git_rev`, hidden tests a seed would
copy into the workspace, and an evaluator whose program is not found.

The evaluator command runs in the execution's sandbox (its uid and limits, without its API key),
in the workspace, after the harness has ended (also after a timeout: partial credit). Its items
may hold `{workspace}`, `{hidden}`, `{scratch}`, `{report}` and `{python}`. A try that yields no
score (killed, no report, no JSON score line, an invalid score, a program that cannot start) is
repeated within `agents.eval_budget_s`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

import yaml

from gyre_ray.envs.base import Task
from gyre_ray.envs.task_scoring import (
    EVAL_PLACEHOLDERS,
    SCORES,
    CommandEvaluator,
    program_problem,
    shown,
    template_problem,
)

TASK_KEYS = {
    *("id", "prompt", "prompt_file", "files", "seed_dir", "git", "git_rev", "hidden", "time_limit_s"),
    "evaluator",
}
EVAL_KEYS = {"score", "command", "timeout_s", "test_timeout_s"}
# The prompt reaches every harness as one environment string (GYRE_TASK_PROMPT) and some as one
# argument; Linux refuses either beyond 128 KiB (MAX_ARG_STRLEN), failing every execution at exec.
PROMPT_MAX_BYTES = 120 << 10
# `git` values that git reads as a URL (scheme://, or scp-like host:path with the colon before any
# slash); anything else is a local path, read from the task file's folder
GIT_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|[^/]*:)")


class TaskFileError(ValueError):
    """A task file that does not follow the documented format."""


def _path(base: Path, value: Any, where: str, kind: str) -> Path:
    """`value` read from `base` (the task file's folder): an existing `kind` ("file" or "folder")."""
    if not isinstance(value, str) or not value:
        raise TaskFileError(f"{where} must be a non-empty path string, got {shown(value)}")
    path = (base / value).resolve()
    if not path.exists():
        raise TaskFileError(f"{where}: {path} does not exist (relative paths are read from {base})")
    if (kind == "folder") != path.is_dir():
        raise TaskFileError(f"{where}: {path} is not a {kind}")
    return path


# Execution ids are f"s{step}-{id}-{g}" (`gyre_ray.agents.launch.plan_step`) and f"eval{step}-{id}-{i}"
# (`gyre_ray.evaluation.plan_round`); the record store takes [A-Za-z0-9_.-], at most 128 characters
# (`gyre_ray.proxy.store.EXECUTION_ID`). 32 of them are left to the wrapper: a 12-digit step and a
# 12-digit index still fit.
EXECUTION_ID_MAX = 128
TASK_ID_MAX = EXECUTION_ID_MAX - 32
TASK_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def _check_task_id(task_id: Any, where: str) -> str:
    if not isinstance(task_id, str) or not task_id:
        got = f"got {type(task_id).__name__} {shown(task_id)}" if task_id is not None else "none given"
        raise TaskFileError(f"{where}: id must be a non-empty string ({got}; quote a number in YAML)")
    bad = sorted(set(task_id) - TASK_ID_CHARS)
    if bad or len(task_id) > TASK_ID_MAX:
        why = f"holds {''.join(bad)!r}" if bad else f"has {len(task_id)} characters"
        raise TaskFileError(
            f"{where}: id {task_id[: TASK_ID_MAX + 8]!r} {why}; an id may hold only letters, digits, "
            f"'_', '.' and '-' (A-Za-z0-9_.-), at most {TASK_ID_MAX} characters"
        )
    return task_id


def _text(raw: dict, key: str, where: str) -> str | None:
    """`raw[key]`, a non-empty string, or None when the key is left out."""
    if key not in raw:
        return None
    value = raw[key]
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else f"{type(value).__name__} {shown(value)}"
        raise TaskFileError(f"{where}: {key} must be a non-empty string, got {got} (quote it in YAML)")
    return value


def _seconds(value: Any, key: str, where: str) -> float | None:
    if value is None:
        return None
    try:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        )
    except OverflowError:  # an integer too large for a float
        ok = False
    if not ok:
        raise TaskFileError(f"{where}: {key} must be a positive number of seconds, got {shown(value)}")
    return float(value)


def _prompt(raw: dict, base: Path, where: str) -> str:
    if ("prompt" in raw) == ("prompt_file" in raw):
        raise TaskFileError(f"{where}: give exactly one of prompt and prompt_file")
    if "prompt" in raw:
        prompt = raw["prompt"]
        if not isinstance(prompt, str):
            raise TaskFileError(f"{where}: prompt must be text, got {type(prompt).__name__}")
    else:
        path = _path(base, raw["prompt_file"], f"{where}: prompt_file", "file")
        try:
            prompt = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TaskFileError(f"{where}: prompt_file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise TaskFileError(f"{where}: prompt_file {path} cannot be read: {exc.strerror}") from None
    if not prompt.strip():
        raise TaskFileError(f"{where}: the prompt is empty")
    if "\x00" in prompt:
        raise TaskFileError(f"{where}: the prompt holds a NUL character, which no process can be given")
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError:
        raise TaskFileError(f"{where}: the prompt holds a lone surrogate (not valid text)") from None
    if size > PROMPT_MAX_BYTES:
        raise TaskFileError(
            f"{where}: the prompt has {size} bytes; at most {PROMPT_MAX_BYTES} (UTF-8): it reaches the "
            "harness as one environment string, which Linux limits to 128 KiB; put the rest in a seed file"
        )
    return prompt


def _seed_files(files: Any, where: str) -> dict[str, str]:
    """`files`: relative paths inside the workspace (no '..', none a folder of another) to text."""
    if not isinstance(files, dict):
        raise TaskFileError(f"{where}: files must map relative paths to text, got {type(files).__name__}")
    seen: dict[PurePosixPath, str] = {}
    for rel, text in files.items():
        path = PurePosixPath(rel) if isinstance(rel, str) and "\x00" not in rel else None
        if path is None or path.is_absolute() or not path.parts or ".." in path.parts:
            raise TaskFileError(
                f"{where}: files key {shown(rel)} must be a relative path inside the workspace "
                "(not absolute, not empty, no '..')"
            )
        if not isinstance(text, str):
            raise TaskFileError(f"{where}: files[{rel!r}] must be text, got {type(text).__name__}")
        if path in seen:
            raise TaskFileError(f"{where}: files {seen[path]!r} and {rel!r} are the same file")
        seen[path] = rel
    for path, rel in seen.items():
        parent = next((seen[p] for p in path.parents if p in seen), None)
        if parent is not None:
            raise TaskFileError(f"{where}: files {parent!r} is a file, so {rel!r} cannot be inside it")
    return dict(files)


def _evaluator(raw: dict, base: Path, where: str) -> CommandEvaluator:
    spec = raw.get("evaluator", {})  # left out: the pytest default over the hidden tests
    if not isinstance(spec, dict):
        raise TaskFileError(f"{where}: evaluator must be a mapping with keys from {sorted(EVAL_KEYS)}")
    unknown = set(spec) - EVAL_KEYS
    if unknown:
        raise TaskFileError(
            f"{where}: evaluator: unknown keys {sorted(map(str, unknown))}; known: {sorted(EVAL_KEYS)}"
        )
    _no_empty_values(spec, f"{where}: evaluator")
    score = spec.get("score", "pytest")
    if score not in SCORES:
        raise TaskFileError(
            f"{where}: evaluator.score must be one of {', '.join(SCORES)}, got {shown(score)}"
        )
    command = spec.get("command")
    if command is not None:
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            raise TaskFileError(f"{where}: evaluator.command must be a non-empty list of strings")
        problem = template_problem(command, EVAL_PLACEHOLDERS)
        if problem:
            raise TaskFileError(f"{where}: evaluator.command {problem}")
        unstartable = program_problem(command[0], search=False)  # installed? asked where it runs
        if unstartable:
            raise TaskFileError(f"{where}: evaluator.command item 0 {command[0]!r} {unstartable}")
        if score == "pytest" and not any("{report}" in c or "{scratch}" in c for c in command):
            raise TaskFileError(
                f"{where}: evaluator.command for score pytest must write its JUnit report to {{report}} "
                "(e.g. --junitxml {report}); no item holds {report} or {scratch}"
            )
        if "test_timeout_s" in spec:
            raise TaskFileError(
                f"{where}: evaluator.test_timeout_s applies to the default pytest command only; "
                "with evaluator.command put the limit in the command"
            )
    elif score != "pytest":
        raise TaskFileError(f"{where}: evaluator.command is required for score {score!r}")
    hidden = _path(base, raw["hidden"], f"{where}: hidden", "folder") if "hidden" in raw else None
    if command is None:
        if hidden is None:
            raise TaskFileError(f"{where}: score pytest without a command needs hidden tests")
        if not any(hidden.rglob("test_*.py")) and not any(hidden.rglob("*_test.py")):
            raise TaskFileError(
                f"{where}: hidden: {hidden} holds no test_*.py or *_test.py file, so pytest would "
                "collect no test and no execution could be scored"
            )
    return CommandEvaluator(
        score, tuple(command) if command else None, hidden,
        _seconds(spec.get("timeout_s"), "evaluator.timeout_s", where) or 120.0,
        _seconds(spec.get("test_timeout_s"), "evaluator.test_timeout_s", where) or 20.0,
    )  # fmt: skip


def _no_empty_values(raw: dict, where: str) -> None:
    empty = sorted(str(k) for k, v in raw.items() if v is None)
    if empty:
        raise TaskFileError(
            f"{where}: {', '.join(empty)} given without a value; give one or leave the key out"
        )


def _git_source(raw: dict, base: Path, where: str) -> tuple[str | None, str | None]:
    """(`git`, `git_rev`): a URL as written, or a local repository's absolute path (read from `base`)."""
    git, rev = _text(raw, "git", where), _text(raw, "git_rev", where)
    if rev is not None and git is None:
        raise TaskFileError(f"{where}: git_rev is given without git")
    for key, value in (("git", git), ("git_rev", rev)):
        if value is not None and (value.startswith("-") or "\x00" in value):
            raise TaskFileError(
                f"{where}: {key} {value!r} must not start with '-' (git would read it as an option) "
                "nor hold a NUL character"
            )
    if git is not None and git.startswith("file://"):  # a local repository all the same: checked as one
        url = urlparse(git)
        if url.netloc not in ("", "localhost"):
            raise TaskFileError(f"{where}: git {git!r} names another host; a file:// URL is a local path")
        git = unquote(url.path)
    if git is None or GIT_URL.match(git):
        return git, rev
    return str(_path(base, git, f"{where}: git (a local repository)", "folder")), rev


def parse_task(raw: Any, base: Path, where: str) -> Task:
    """One task from its mapping (`base`: the task file's folder)."""
    if not isinstance(raw, dict):
        raise TaskFileError(f"{where}: a task must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - TASK_KEYS
    if unknown:
        raise TaskFileError(f"{where}: unknown keys {sorted(map(str, unknown))}; known: {sorted(TASK_KEYS)}")
    task_id = _check_task_id(raw.get("id"), where)
    where = f"{where} ({task_id})"
    _no_empty_values(raw, where)
    prompt = _prompt(raw, base, where)
    files = _seed_files(raw.get("files", {}), where)
    evaluator = _evaluator(raw, base, where)
    git, git_rev = _git_source(raw, base, where)
    seed_dir = _path(base, raw["seed_dir"], f"{where}: seed_dir", "folder") if "seed_dir" in raw else None
    time_limit = _seconds(raw.get("time_limit_s"), "time_limit_s", where)
    return Task(task_id, prompt, evaluator, files, time_limit, seed_dir, git, git_rev)


def _git(args: list[str]) -> subprocess.CompletedProcess:
    """`git ARGS`, its output captured; a git that cannot run is a failed run saying why."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=60, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(["git", *args], 1, "", f"fatal: git could not run: {exc}")


def _check_seeds(tasks: list[Task], wheres: dict[str, str]) -> None:
    """No `seed_dir` holds any task's hidden tests; git is installed where a task clones; a local `git`
    seed is a repository git will clone (with its `git_rev` branch or tag) that tracks no task's
    hidden tests."""
    hidden = {t.task_id: h for t in tasks if (h := getattr(t.evaluate, "hidden", None)) is not None}
    refs: dict[str, set[str]] = {}
    git_found = any(t.git is not None for t in tasks) and shutil.which("git") is not None
    for task in tasks:
        where = wheres[task.task_id]
        if task.git is not None and not git_found:
            raise TaskFileError(f"{where}: git is given, but no git program is on PATH to clone it")
        for owner, folder in hidden.items() if task.seed_dir is not None else ():
            if folder == task.seed_dir or task.seed_dir in folder.parents:
                raise TaskFileError(
                    f"{where}: seed_dir {task.seed_dir} holds the hidden tests of task {owner!r} ({folder}): "
                    "they would be copied into the workspace"
                )
            if folder in task.seed_dir.parents:
                raise TaskFileError(
                    f"{where}: seed_dir {task.seed_dir} lies inside the hidden tests of task {owner!r} "
                    f"({folder}): its files would be copied into the workspace"
                )
        if task.git is None or not os.path.isabs(task.git):
            continue
        if task.git not in refs:
            listed = _git(["ls-remote", "--", task.git])
            if listed.returncode != 0:
                lines = [line for line in listed.stderr.splitlines() if line.startswith("fatal:")]
                why = lines[0] if lines else listed.stderr.strip() or f"exit code {listed.returncode}"
                raise TaskFileError(f"{where}: git {task.git} cannot be cloned: {why}")
            refs[task.git] = {line.split("\t", 1)[-1] for line in listed.stdout.splitlines()}
        if task.git_rev and not {f"refs/heads/{task.git_rev}", f"refs/tags/{task.git_rev}"} & refs[task.git]:
            raise TaskFileError(
                f"{where}: git_rev {task.git_rev!r} is no branch or tag of {task.git} "
                "(the clone takes a branch or tag name, not a commit)"
            )
        repo = Path(task.git)
        for owner, folder in hidden.items():
            if folder == repo or repo in folder.parents:
                rel = os.path.relpath(folder, repo)
                # a local clone takes every branch and tag with their history: any commit is enough
                tracked = _git(["-C", str(repo), "log", "--all", "--format=%H", "-1", "--", rel])
                if tracked.stdout.strip():
                    raise TaskFileError(
                        f"{where}: git {repo} tracks the hidden tests of task {owner!r} ({rel}) in its "
                        "history: the clone would put them in the workspace"
                    )


def _read_records(path: Path, data: bytes) -> list[tuple[Any, str]]:
    """The raw tasks of the file (its bytes `data`), each with where it is (`name:line` or `name: task i`)."""
    from gyre_ray.config import _UniqueKeyLoader  # the config's YAML loader: a repeated key is an error

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFileError(f"{path.name}: not UTF-8 text") from None
    if path.suffix == ".jsonl":
        raws = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raws.append((json.loads(line, object_pairs_hook=_unique_keys), f"{path.name}:{number}"))
                except _RepeatedKey as exc:
                    raise TaskFileError(f"{path.name}:{number}: {exc}") from None
                except ValueError as exc:
                    raise TaskFileError(f"{path.name}:{number}: not JSON: {exc}") from None
        return raws
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise TaskFileError(f"{path.name}: not YAML: {exc}") from None
    if isinstance(data, dict):
        if "tasks" not in data:  # other keys may hold what anchors name (`defaults: &d {...}`)
            raise TaskFileError(
                f"{path.name}: a mapping at the top must hold 'tasks' (the list of tasks), "
                f"got keys {sorted(map(str, data))}"
            )
        data = data["tasks"]
    if not isinstance(data, list):
        raise TaskFileError(f"{path.name}: expected a list of tasks (or a mapping with 'tasks')")
    return [(raw, f"{path.name}: task {i}") for i, raw in enumerate(data)]


class _RepeatedKey(ValueError):
    """A key given twice in one JSON object (json keeps the last one silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) < len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _RepeatedKey(f"key {repeated!r} is given twice in one object")
    return found


_LOADED: dict[tuple[Path, str], list[Task]] = {}  # per process: every execution looks its task up


def load_task_file(path: Path) -> list[Task]:
    """The tasks of a .jsonl or .yaml/.yml task file (errors name the file, line or index). Checked
    once per process and content of the file (the checks run git and search PATH: every execution of
    a run looks its task up here)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise TaskFileError(
            f"task file {path} does not exist" if not path.exists() else f"{path} is not a file"
        )
    data = path.read_bytes()
    key = (path, hashlib.sha256(data).hexdigest())
    if key not in _LOADED:
        _LOADED[key] = _load_checked(path, data)
    return list(_LOADED[key])


def _load_checked(path: Path, data: bytes) -> list[Task]:
    raws = _read_records(path, data)
    tasks, wheres = [], {}
    for raw, where in raws:
        task = parse_task(raw, path.parent, where)
        if task.task_id in wheres:
            raise TaskFileError(
                f"{path.name}: task id {task.task_id!r} appears twice ({wheres[task.task_id]}, {where})"
            )
        tasks.append(task)
        wheres[task.task_id] = f"{where} ({task.task_id})"
    if not tasks:
        raise TaskFileError(f"{path.name}: no tasks")
    _check_seeds(tasks, wheres)
    return tasks
