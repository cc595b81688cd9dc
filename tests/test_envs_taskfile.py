"""Task sets from files: the documented format, hidden-test scoring with partial credit (also after a
timeout), evaluator retries within the budget, and the shipped mini NL2Repo set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.envs.base import get_task_set
from gyre_ray.envs.nl2repo import nl2repo_mini_path
from gyre_ray.envs.taskfile import TaskFileError, load_task_file

NOWHERE = Endpoint("http://127.0.0.1:9", "key")
RLE_HALF = (  # encode right, decode wrong: 2 of the 4 hidden tests pass
    "import os; os.makedirs('rlekit', exist_ok=True); open('rlekit/__init__.py','w').write("
    "'import itertools\\n"
    "def encode(t): return [(k, len(list(g))) for k, g in itertools.groupby(t)]\\n"
    'def decode(runs): return ""\\n\')'
)
ROMAN_FULL = (
    "import os; os.makedirs('romankit', exist_ok=True); open('romankit/__init__.py','w').write('''\n"
    "PAIRS = [(1000,'M'),(900,'CM'),(500,'D'),(400,'CD'),(100,'C'),(90,'XC'),(50,'L'),(40,'XL'),"
    "(10,'X'),(9,'IX'),(5,'V'),(4,'IV'),(1,'I')]\n"
    "def to_roman(n):\n"
    "    if not 1 <= n <= 3999: raise ValueError(n)\n"
    "    out = ''\n"
    "    for v, s in PAIRS:\n"
    "        while n >= v: out += s; n -= v\n"
    "    return out\n"
    "def from_roman(s):\n"
    "    n = 0\n"
    "    for v, sym in PAIRS:\n"
    "        while s.startswith(sym): n += v; s = s[len(sym):]\n"
    "    return n\n''')"
)


def _task(set_name: str, task_id: str):
    return next(t for t in get_task_set(set_name) if t.task_id == task_id)


def _run(task, exec_tmp: Path, code: str, name: str = "ws", **kw):
    return run_execution(name, task, NOWHERE, exec_tmp / name, command=[sys.executable, "-c", code], **kw)


def test_the_shipped_set_loads_and_keeps_its_tests_hidden(exec_tmp: Path) -> None:
    tasks = get_task_set("nl2repo-mini")
    assert [t.task_id for t in tasks] == ["slugkit", "romankit", "rlekit", "rpnkit"]
    assert all("Build a Python package" in t.prompt for t in tasks)
    hidden = nl2repo_mini_path().parent / "hidden/slugkit"
    probe = (
        f"import os, json\ntry:\n    shipped = os.listdir({str(hidden)!r})\nexcept OSError as exc:\n"
        "    shipped = type(exc).__name__\njson.dump([sorted(os.listdir('.')), shipped], open('seen.json', 'w'))"
    )
    out = _run(_task("nl2repo-mini", "slugkit"), exec_tmp, probe, timeout_s=30)
    # no test file in the workspace, and the task file's own hidden folder is closed to the agent
    assert json.loads((exec_tmp / "ws/seen.json").read_text()) == [[], "PermissionError"]
    assert out.valid and out.reward == 0.0 and "0/1 hidden tests passed" in out.detail  # import error


def test_score_is_the_share_of_hidden_tests_passed(exec_tmp: Path) -> None:
    full = _run(_task("nl2repo-mini", "romankit"), exec_tmp, ROMAN_FULL, "full", timeout_s=30)
    assert full.valid and full.reward == 1.0 and full.detail == "4/4 hidden tests passed"
    half = _run(_task("nl2repo-mini", "rlekit"), exec_tmp, RLE_HALF, "half", timeout_s=30)
    assert half.valid and half.reward == 0.5 and half.detail == "2/4 hidden tests passed"


def test_a_timed_out_run_still_scores_its_workspace(exec_tmp: Path) -> None:
    out = _run(
        _task("nl2repo-mini", "rlekit"), exec_tmp, RLE_HALF + "; import time; time.sleep(60)", timeout_s=3
    )
    assert out.timed_out and out.valid and out.reward == 0.5
    assert out.reason == "timed out" and out.detail.startswith("timed out; 2/4")


def test_a_conftest_or_pytest_ini_in_the_workspace_cannot_fake_a_pass(exec_tmp: Path) -> None:
    cheat = (
        RLE_HALF + "; open('conftest.py','w').write('import pytest\\n"
        "@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item): pass\\n')"
        "; open('pytest.ini','w').write('[pytest]\\naddopts = -p no:junitxml\\n')"
    )
    out = _run(_task("nl2repo-mini", "rlekit"), exec_tmp, cheat, timeout_s=30)
    assert out.valid and out.reward == 0.5


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_jsonl_task_file_with_seed_files_a_git_seed_and_a_json_score(exec_tmp: Path) -> None:
    repo = exec_tmp / "seedrepo"
    _write(repo / "data.txt", "from git\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "seed"], check=True)
    judge = "import json, pathlib; n = len(pathlib.Path('out.txt').read_text()); print(json.dumps(dict(score=min(1.0, n / 10))))"
    task = {
        "id": "copy",
        "prompt": "copy data.txt to out.txt",
        "git": "seedrepo",
        "files": {"notes/hint.md": "use cp"},
        "evaluator": {"score": "json", "command": ["{python}", "-c", judge]},
        "time_limit_s": 9,
    }
    path = _write(exec_tmp / "set.jsonl", json.dumps(task) + "\n")
    (loaded,) = load_task_file(path)
    assert loaded.time_limit_s == 9
    code = "import shutil, os; assert os.path.exists('notes/hint.md'); shutil.copy('data.txt', 'out.txt')"
    out = _run(loaded, exec_tmp, code, timeout_s=30)
    assert out.valid and out.reward == pytest.approx(0.9), out.detail
    assert AgentSection(task_set=str(path)).task_set == str(path.resolve())


def test_a_failing_evaluator_is_retried_within_the_budget_then_dropped(exec_tmp: Path) -> None:
    flaky = (  # fails on its first try, scores on its second
        "import json, pathlib; p = pathlib.Path('{scratch}/tries'); n = int(p.read_text()) if p.exists() else 0; "
        "p.write_text(str(n + 1)); print(json.dumps({{'score': 0.25}}) if n else 'crash')"
    )
    tasks = [
        {"id": "flaky", "prompt": "x", "evaluator": {"score": "json", "command": ["{python}", "-c", flaky]}},
        {
            "id": "never",
            "prompt": "x",
            "evaluator": {"score": "exit-code", "command": ["sleep", "30"], "timeout_s": 0.5},
        },
    ]
    path = _write(exec_tmp / "set.yaml", json.dumps({"tasks": tasks}))  # YAML is a superset of JSON
    flaky_task, never_task = load_task_file(path)
    out = _run(flaky_task, exec_tmp, "pass", "a", timeout_s=30, eval_budget_s=20)
    assert out.valid and out.reward == 0.25 and "after 2 evaluator tries" in out.detail
    out = _run(
        never_task, exec_tmp, "pass", "b", timeout_s=30, eval_budget_s=3
    )  # two tries at least, also on a loaded machine
    assert not out.valid and "evaluator timed out" in out.reason and "evaluator tries" in out.detail
    # a harness that also timed out: the drop is the evaluator's, so its reason comes first (the
    # step's drop_reasons count the first clause; they used to say "timed out")
    out = _run(never_task, exec_tmp, "import time; time.sleep(30)", "c", timeout_s=1, eval_budget_s=1)
    assert not out.valid and out.timed_out
    assert out.reason.startswith("evaluator timed out") and out.reason.endswith("; timed out"), out.reason


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"id": "a", "evaluator": {"score": "json", "command": ["x"]}}', "exactly one of prompt"),
        ('{"id": "a", "prompt": "p", "evaluator": {"score": "bleu"}}', "evaluator.score must be one of"),
        ('{"id": "a", "prompt": "p", "evaluator": {"score": "json"}}', "evaluator.command is required"),
        ('{"id": "a", "prompt": "p", "hidden": "nope", "evaluator": {}}', "does not exist"),
        ('{"id": "a", "prompt": "p", "colour": 1, "evaluator": {}}', "unknown keys"),
        ("not json", "not JSON"),
    ],
)
def test_bad_task_files_are_refused_with_the_place_named(exec_tmp: Path, text: str, message: str) -> None:
    path = _write(exec_tmp / "bad.jsonl", text + "\n")
    with pytest.raises(TaskFileError, match=message):
        load_task_file(path)
    with pytest.raises(ValueError, match="unknown task set"):
        get_task_set("no-such-set")


def test_a_task_without_an_evaluator_is_scored_by_its_hidden_tests(exec_tmp: Path) -> None:
    """`evaluator` left out means the documented default: pytest over the hidden tests."""
    hidden = exec_tmp / "hidden"
    hidden.mkdir()
    (hidden / "test_x.py").write_text(
        "import answer\n\ndef test_x():\n    assert answer.X == 1\n\ndef test_y():\n    assert answer.Y == 2\n"
    )
    path = _write(exec_tmp / "tasks.jsonl", '{"id": "a", "prompt": "p", "hidden": "hidden"}\n')
    (task,) = load_task_file(path)
    assert task.evaluate.score == "pytest" and task.evaluate.hidden == hidden
    # and it scores so: the share of the hidden tests the workspace passes
    out = _run(task, exec_tmp, "open('answer.py', 'w').write('X = 1\\nY = 3\\n')", timeout_s=30)
    assert out.valid and out.reward == 0.5 and out.detail == "1/2 hidden tests passed", out.detail
    # a workspace path holding a space or a quote is importable too (pytest splits its ini value
    # like a shell line: the workspace was two paths, and every test failed to import)
    code = "open('answer.py', 'w').write('X = 1\\nY = 2\\n')"
    spaced = exec_tmp / "it's runs" / "ws2"
    spaced.parent.mkdir()
    out = run_execution("ws2", task, NOWHERE, spaced, command=[sys.executable, "-c", code], timeout_s=30)
    assert out.valid and out.reward == 1.0 and out.detail == "2/2 hidden tests passed", out.detail
    no_tests = _write(exec_tmp / "bare.jsonl", '{"id": "b", "prompt": "p"}\n')
    with pytest.raises(TaskFileError, match="needs hidden tests"):
        load_task_file(no_tests)


def test_the_job_never_writes_through_a_link_the_evaluated_code_planted(exec_tmp: Path) -> None:
    """The evaluator's scratch folder is the execution's: code pytest imports on a first try swaps
    pytest.ini for a link to a file of the job's and fails; the retry must not write through it."""
    victim = _write(exec_tmp / "victim.txt", "the job's own file\n")
    victim.chmod(0o600)
    (exec_tmp / "hidden").mkdir()
    (exec_tmp / "hidden/test_evil.py").write_text("import evil\n\ndef test_ok():\n    assert evil.ok\n")
    evil = (
        "import os, sys\n"
        "ini = sys.argv[sys.argv.index('-c') + 1]\n"
        "if not os.path.exists(ini + '.planted'):\n"
        "    open(ini + '.planted', 'w').close()\n"
        f"    os.unlink(ini); os.symlink({str(victim)!r}, ini); os._exit(3)\n"
        "ok = True\n"
    )
    agent = f"import os; os.makedirs('evil'); open('evil/__init__.py', 'w').write({evil!r})"
    tasks = [{"id": "evil", "prompt": "x", "hidden": "hidden", "evaluator": {"timeout_s": 30}}]
    (task,) = load_task_file(_write(exec_tmp / "set.yaml", json.dumps({"tasks": tasks})))
    out = _run(task, exec_tmp, agent, "s0-evil-0", timeout_s=30, eval_budget_s=20)
    assert victim.read_text() == "the job's own file\n" and victim.stat().st_mode & 0o777 == 0o600
    assert out.valid and out.reward == 1.0 and "after 2 evaluator tries" in out.detail
