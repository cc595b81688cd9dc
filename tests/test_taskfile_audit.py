"""A new user's own task file and `command` harness: every mistake is refused when the file or config
is loaded, in one message naming the place, the key and what is allowed (none was a traceback, a
silent default or a failure in every execution); an evaluator's score is never misread; and the
task-file features give an execution no way into the source repository or another workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from pydantic import ValidationError

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.harnesses import build_harness, check_command_template
from gyre_ray.agents.runner import run_execution
from gyre_ray.envs.base import Task
from gyre_ray.envs.task_scoring import CommandEvaluator, json_line_score
from gyre_ray.envs.taskfile import PROMPT_MAX_BYTES, TaskFileError, load_task_file
from tests.test_cli_user_errors import run as run_cli
from tests.test_envs_taskfile import NOWHERE, _run, _write

OK = {"score": "exit-code", "command": ["true"]}  # an evaluator that loads anywhere


def _repo(path: Path, files: dict[str, str], tag: str | None = None) -> Path:
    """A git repository at `path` with one commit of `files` (and `tag` on it)."""
    for rel, text in files.items():
        _write(path / rel, text)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(path)]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "seed"], check=True)
    if tag:
        subprocess.run([*git, "tag", tag], check=True)
    return path


def _refused(path: Path) -> str:
    with pytest.raises(TaskFileError) as refused:
        load_task_file(path)
    return str(refused.value)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A task folder: hidden tests, a seed folder, a plain file, a folder, a non-UTF-8 file."""
    _write(tmp_path / "hidden/test_a.py", "def test_a():\n    pass\n")
    _write(tmp_path / "hidden/sub/data.txt", "expected output\n")
    _write(tmp_path / "seeds/README.md", "seed\n")
    _write(tmp_path / "afile", "x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "latin1.md").write_bytes(b"caf\xe9\n")
    (tmp_path / "notests").mkdir()
    return tmp_path


def _task(**fields) -> dict:
    return {"id": "t", "prompt": "p", "hidden": "hidden", **fields}


BAD_TASKS = [  # each was accepted (and failed or misbehaved later) or raised a traceback
    (_task(files=[]), "files must map relative paths to text, got list"),
    (_task(files=""), "files must map relative paths to text, got str"),
    (_task(files={"/etc/cron.d/x": "y"}), "files key '/etc/cron.d/x' must be a relative path inside"),
    (_task(files={"../x": "y"}), "files key '../x' must be a relative path inside the workspace"),
    (_task(files={"": "y"}), "files key '' must be a relative path"),
    (_task(files={"a": "1", "a/b": "2"}), "files 'a' is a file, so 'a/b' cannot be inside it"),
    (_task(files={"a": "1", "./a": "2"}), "files 'a' and './a' are the same file"),
    (_task(files={"x": 1}), "files['x'] must be text, got int"),
    (_task(time_limit_s=0), "time_limit_s must be a positive number of seconds, got 0"),
    (_task(time_limit_s=True), "time_limit_s must be a positive number of seconds, got True"),
    (_task(time_limit_s=float("inf")), "time_limit_s must be a positive number of seconds, got inf"),
    (_task(evaluator={"timeout_s": 0}), "evaluator.timeout_s must be a positive number of seconds, got 0"),
    (_task(time_limit_s=None), "time_limit_s given without a value; give one or leave the key out"),
    (_task(evaluator={"score": None}), "evaluator: score given without a value"),
    (_task(evaluator={"scor": "json"}), "evaluator: unknown keys ['scor']"),
    (_task(evaluator={"score": "json", "command": []}), "evaluator.command must be a non-empty list"),
    (_task(evaluator={"score": "json", "command": [""]}), "item 0 '' is empty"),
    (
        _task(evaluator={"score": "json", "command": ["judges/check.sh"]}),
        "is a relative path, which would be read from",
    ),
    (
        _task(evaluator={"command": ["{python}", "-m", "pytest", "{hidden}"]}),
        "must write its JUnit report to {report}",
    ),
    (
        _task(evaluator={**OK, "test_timeout_s": 5}),
        "test_timeout_s applies to the default pytest command only",
    ),
    (_task(hidden="notests"), "holds no test_*.py or *_test.py file"),
    (_task(hidden="afile"), "hidden: {folder}/afile is not a folder"),
    (_task(seed_dir="afile"), "seed_dir: {folder}/afile is not a folder"),
    (_task(seed_dir="."), "seed_dir {folder} holds the hidden tests of task 't'"),
    (_task(seed_dir="hidden/sub"), "seed_dir {folder}/hidden/sub lies inside the hidden tests of task 't'"),
    (_task(git=""), "git must be a non-empty string, got an empty string"),
    (_task(git="--upload-pack=touch /tmp/x"), "must not start with '-'"),
    (_task(git="missing-repo"), "git (a local repository): {folder}/missing-repo does not exist"),
    (_task(git="seeds"), "git {folder}/seeds cannot be cloned: fatal:"),
    (_task(git_rev="main"), "git_rev is given without git"),
    (_task(git="https://h/r.git", git_rev=2024), "git_rev must be a non-empty string, got int 2024"),
    (_task(prompt=5), "prompt must be text, got int"),
    (_task(prompt="a\u0000b"), "the prompt holds a NUL character"),
    (_task(prompt="x" * (PROMPT_MAX_BYTES + 1)), f"at most {PROMPT_MAX_BYTES} (UTF-8)"),
    ({"id": "t", "prompt_file": "adir", "hidden": "hidden"}, "prompt_file: {folder}/adir is not a file"),
    (
        {"id": "t", "prompt_file": "latin1.md", "hidden": "hidden"},
        "prompt_file {folder}/latin1.md is not UTF-8",
    ),
    ({"id": "t", "prompt_file": "", "hidden": "hidden"}, "(t): prompt_file must be a non-empty path"),
]


@pytest.mark.parametrize("task, message", BAD_TASKS)
def test_a_bad_task_is_refused_naming_the_line_the_task_and_the_key(
    folder: Path, task: dict, message: str
) -> None:
    path = _write(folder / "tasks.jsonl", json.dumps(task) + "\n")
    assert _refused(path).startswith("tasks.jsonl:1 (t): ")
    assert message.replace("{folder}", str(folder)) in _refused(path)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("t.jsonl", '{"id": "a", "prompt": "one", "prompt": "two"}\n', "t.jsonl:1: key 'prompt' is given twice"),
        ("t.yaml", "- id: a\n  prompt: one\n  prompt: two\n", "key 'prompt' is given twice in one mapping"),
        ("t.yaml", "task: []\ndefaults: {time_limit_s: 3}\n", "a mapping at the top must hold 'tasks'"),
        ("t.yaml", "- {id: 2024, prompt: p}\n", "t.yaml: task 0: id must be a non-empty string (got int 2024"),
        ("t.jsonl", '{"id": "a"}\n', "t.jsonl: not UTF-8 text"),
        ("t.yaml", "- {id: a, prompt: x, hidden: hidden}\n- {id: a, prompt: y, hidden: hidden}\n",
         "task id 'a' appears twice (t.yaml: task 0 (a), t.yaml: task 1)"),
    ],
)  # fmt: skip
def test_repeated_keys_stray_top_keys_and_bad_encodings_are_refused(
    folder: Path, name: str, text: str, message: str
) -> None:
    path = _write(folder / name, text)
    if message.endswith("not UTF-8 text"):
        path.write_bytes(b"\xff" + text.encode())
    assert message in _refused(path)


def test_gyre_ray_config_says_a_bad_prompt_file_in_one_message(
    folder: Path, capsys: pytest.CaptureFixture
) -> None:
    path = _write(folder / "tasks.jsonl", json.dumps({"id": "t", "prompt_file": "adir", "hidden": "hidden"}))
    code, _, err = run_cli(capsys, "config", f"agents.task_set={path}")  # was IsADirectoryError
    assert code == 2 and "Traceback" not in err
    assert f"agents.task_set: tasks.jsonl:1 (t): prompt_file: {folder}/adir is not a file" in err


def test_a_local_git_seed_is_read_from_the_task_folder_and_checked(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _repo(folder / "repo", {"src/app.py": "x = 1\n"}, tag="v1")
    monkeypatch.chdir(folder / "adir")  # relative paths are the task file's, not the current folder's
    path = _write(
        folder / "tasks.jsonl",
        json.dumps({"id": "g", "prompt": "p", "git": "repo", "git_rev": "v1", "evaluator": OK}),
    )
    (task,) = load_task_file(path)
    assert task.git == str(folder / "repo") and task.git_rev == "v1"
    head = subprocess.run(["git", "-C", task.git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    path.write_text(
        json.dumps({"id": "g", "prompt": "p", "git": "repo", "git_rev": head.strip(), "evaluator": OK})
    )
    assert "is no branch or tag of" in _refused(
        path
    )  # a commit: `clone --branch` would fail in every execution


@pytest.mark.parametrize("given", [".", "file://{folder}"])
def test_a_local_git_seed_tracking_hidden_tests_is_refused(folder: Path, given: str) -> None:
    _repo(folder, {"README.md": "tasks\n"})  # the task folder is itself a repository, hidden/ tracked
    tasks = [
        {"id": "a", "prompt": "p", "hidden": "hidden"},
        {"id": "b", "prompt": "p", "git": given.format(folder=folder), "evaluator": OK},
    ]
    path = _write(folder / "tasks.jsonl", "\n".join(json.dumps(t) for t in tasks))
    assert f"tasks.jsonl:2 (b): git {folder} tracks the hidden tests of task 'a' (hidden)" in _refused(path)


def test_a_local_git_seed_is_a_copy_an_execution_cannot_write_back_through(exec_tmp: Path) -> None:
    """git's local clone hard-links the source's objects; the workspace, handed to the execution's uid,
    then let it rewrite the source repository's objects (and those of every other clone)."""
    repo = _repo(exec_tmp / "tasks/repo", {"data.txt": "from git\n"})
    task = {"id": "g", "prompt": "p", "git": "repo", "evaluator": OK}
    (loaded,) = load_task_file(_write(exec_tmp / "tasks/tasks.jsonl", json.dumps(task)))
    before = {p: p.read_bytes() for p in (repo / ".git/objects").rglob("*") if p.is_file()}
    tamper = (
        "import glob, os\nfor f in glob.glob('.git/objects/*/*'):\n"
        "    os.chmod(f, 0o644); open(f, 'ab').write(b'TAMPERED')\n"
    )
    out = _run(loaded, exec_tmp, tamper, timeout_s=30)
    assert out.valid and out.reward == 1.0 and (exec_tmp / "ws/data.txt").read_text() == "from git\n"
    after = {p: p.read_bytes() for p in (repo / ".git/objects").rglob("*") if p.is_file()}
    assert after == before and all(p.stat().st_uid == os.geteuid() for p in after)


def test_a_failed_clone_says_what_git_said(tmp_path: Path) -> None:
    task = Task("g", "p", lambda ws: None, git="file:///no/such/repo.git")
    with pytest.raises(RuntimeError, match=r"task g: git clone of file:///no/such/repo.git failed: .*fatal"):
        task.seed_workspace(tmp_path / "ws")


@pytest.mark.parametrize(
    "output, detail",
    [
        ('{"score": 0.3}\n{"score": 1.5}', "holds 1.5, not a number in [0, 1]"),  # was 0.3, the earlier line
        ('{"score": NaN}', "holds nan, not a number"),
        ('{"score": "0.5"}', "holds '0.5', not a number"),
        ('{"score": true}', "holds True, not a number"),
    ],
)
def test_the_last_score_line_decides_and_a_bad_score_there_is_named(output: str, detail: str) -> None:
    result = json_line_score(output)
    assert not result.valid and detail in result.detail
    kept = json_line_score('{"score": 0.25}\n{"progress": 3}\n\x00garbage')  # no score key: not a score line
    assert kept.valid and kept.reward == 0.25


def test_an_evaluator_that_cannot_start_is_no_score_of_zero(exec_tmp: Path) -> None:
    """`exit-code` scored a judge that could not be executed (the wrapper's exit 127) as 0.0."""
    judge = _write(exec_tmp / "judge.sh", "#!/bin/sh\nexit 0\n")
    judge.chmod(0o755)
    task = Task("j", "p", CommandEvaluator("exit-code", (str(judge),), None))
    judge.unlink()  # gone between loading and scoring
    out = _run(task, exec_tmp, "pass", timeout_s=30, eval_budget_s=1)
    assert not out.valid and f"evaluator cannot start: '{judge}' is not an executable file" in out.reason


def test_a_judge_script_in_the_hidden_folder_stays_executable(exec_tmp: Path) -> None:
    judge = _write(exec_tmp / "tasks/judges/judge.sh", "#!/bin/sh\ntest -f answer.txt\n")
    judge.chmod(0o700)
    task = {
        "id": "j",
        "prompt": "p",
        "hidden": "judges",
        "evaluator": {"score": "exit-code", "command": ["{hidden}/judge.sh"]},
    }
    (loaded,) = load_task_file(_write(exec_tmp / "tasks/tasks.jsonl", json.dumps(task)))
    out = _run(loaded, exec_tmp, "open('answer.txt', 'w').write('42')", timeout_s=30, eval_budget_s=5)
    # was 0.0 (copied 0644: "Permission denied"), then a SandboxError: the job tried to open the
    # execution's own scratch folder to its group as if it were one of the job's folders
    assert out.valid and out.reward == 1.0, out.detail


def test_a_harness_script_the_task_seeds_runs_as_the_first_item(exec_tmp: Path) -> None:
    """`agents.command=["{workspace}/run.sh", ...]`, the form the config tells a relative path to take."""
    script = _write(exec_tmp / "tasks/seed/run.sh", "#!/bin/sh\necho done > answer.txt\n")
    script.chmod(0o755)
    task = {
        "id": "s",
        "prompt": "p",
        "seed_dir": "seed",
        "evaluator": {"score": "exit-code", "command": ["test", "-s", "answer.txt"]},
    }
    (loaded,) = load_task_file(_write(exec_tmp / "tasks/tasks.jsonl", json.dumps(task)))
    template = check_command_template(["{workspace}/run.sh", "{prompt}"])
    spec = build_harness("command", "p", base_url="http://127.0.0.1:9", workspace=exec_tmp / "ws",
                         home=exec_tmp / "ws.home", as_root=False, template=template)  # fmt: skip
    out = run_execution(
        "ws", loaded, NOWHERE, exec_tmp / "ws", command=spec.command, timeout_s=30, eval_budget_s=5
    )
    assert out.valid and out.reward == 1.0 and out.exit_code == 0, out.detail


# --- agents.harness=command --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"command": ["my-agent", "{prompt}"]}, "agents.command is used only by agents.harness=command"),
        ({"harness_args": ["--x"]}, "harness 'toy' would ignore it"),
        (
            {"harness": "command", "command": ["a"], "harness_args": ["--x"]},
            "put the arguments in agents.command",
        ),
        ({"harness": "command", "command": ["./my_agent.sh"]}, "item 0 './my_agent.sh' is a relative path"),
        ({"harness": "command", "command": ["", "{prompt}"]}, "item 0 '' is empty"),
    ],
)
def test_a_command_harness_setting_that_would_be_ignored_or_misread_is_refused(
    fields: dict, message: str
) -> None:
    with pytest.raises(ValidationError, match=message.replace(".", r"\.").replace("(", r"\(")):
        AgentSection(**fields)
    assert AgentSection(harness="command", command=["{workspace}/run.sh", "{prompt}"]).command
    assert AgentSection(harness="claude-code", harness_args=["--tools", "Write"]).harness_args


def test_gyre_ray_config_names_the_ignored_agents_command(capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_cli(capsys, "config", f"agents.command=[{sys.executable}, agent.py]")
    assert code == 2 and "Traceback" not in err
    assert "agents.command is used only by agents.harness=command (harness is 'toy')" in err


def test_yaml_anchors_and_merge_keys_serve_tasks(folder: Path) -> None:
    """A `defaults: &d` block beside `tasks:` and `<<: *d` in each task (a key of the task's own
    overrides the merged one; a key given twice in one task is still refused)."""
    text = (
        "defaults: &d {prompt: shared, hidden: hidden, time_limit_s: 30}\n"
        "tasks:\n  - {<<: *d, id: a}\n  - {<<: *d, id: b, time_limit_s: 60}\n"
    )
    a, b = load_task_file(_write(folder / "t.yaml", text))
    assert (a.task_id, a.prompt, a.time_limit_s) == ("a", "shared", 30)
    assert (b.task_id, b.time_limit_s) == ("b", 60)
    twice = _write(folder / "u.yaml", "defaults: &d {prompt: p}\ntasks:\n  - {<<: *d, id: a, id: b}\n")
    assert "key 'id' is given twice in one mapping" in _refused(twice)


def test_a_local_git_seed_keeps_its_history_and_no_hidden_tests_in_it(exec_tmp: Path) -> None:
    """A local clone is a full copy (git ignores --depth there: `git log` works in the workspace), so
    hidden tests anywhere in the repository's history are refused, not only at its tip."""
    repo = _repo(exec_tmp / "tasks/repo", {"data.txt": "one\n"})
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(repo)]
    _write(repo / "data.txt", "two\n")
    subprocess.run([*git, "commit", "-qam", "second"], check=True)
    ws = exec_tmp / "clone"
    Task("g", "p", lambda w: None, git=str(repo)).seed_workspace(ws)
    log = subprocess.run(
        ["git", "-C", str(ws), "log", "--format=%s"], capture_output=True, text=True, check=True
    )
    assert log.stdout.split() == ["second", "seed"]
    _write(repo / "hidden/test_a.py", "def test_a():\n    pass\n")
    subprocess.run([*git, "add", "hidden"], check=True)
    subprocess.run([*git, "commit", "-qm", "tests"], check=True)
    subprocess.run([*git, "rm", "-rq", "hidden"], check=True)
    subprocess.run([*git, "commit", "-qm", "tests gone"], check=True)
    _write(repo / "hidden/test_a.py", "def test_a():\n    pass\n")  # on disk, untracked, at the tip
    tasks = [
        {"id": "a", "prompt": "p", "hidden": "repo/hidden"},
        {"id": "b", "prompt": "p", "git": "repo", "evaluator": OK},
    ]
    path = _write(exec_tmp / "tasks/tasks.jsonl", "\n".join(json.dumps(t) for t in tasks))
    assert "tracks the hidden tests of task 'a' (hidden) in its history" in _refused(path)


def test_file_urls_and_huge_numbers_are_read_as_written(folder: Path) -> None:
    repo = _repo(folder / "my repo", {"a.txt": "x\n"})
    for url in (f"file://{quote(str(repo))}", f"file://localhost{quote(str(repo))}"):
        (task,) = load_task_file(_write(folder / "t.jsonl", json.dumps(_task(git=url))))
        assert task.git == str(repo)
    bad = _write(folder / "u.jsonl", json.dumps(_task(git="file://otherhost/srv/repo")))
    assert "names another host" in _refused(bad)
    huge = _write(
        folder / "v.jsonl",
        '{"id": "t", "prompt": "p", "hidden": "hidden", "time_limit_s": 1' + "0" * 400 + "}",
    )
    assert "time_limit_s must be a positive number of seconds" in _refused(huge)


def test_a_link_in_the_workspace_makes_the_job_open_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluator named `{workspace}/check.sh` that the agent replaced by a link to a job-owned
    program: the job grants the execution's group nothing on the link's target."""
    from gyre_ray.agents import sandbox

    workspace, secret = tmp_path / "ws", tmp_path / "secret/bin/tool"
    _write(secret, "#!/bin/sh\n").chmod(0o755)
    workspace.mkdir()
    (workspace / "check.sh").symlink_to(secret)
    granted: list[Path] = []
    monkeypatch.setattr(sandbox, "grant_traverse", lambda path, gid: granted.append(Path(path)))
    identity = sandbox.Identity(uid=12345, gid=12345, name="x", dedicated=True, folders=[workspace])
    sandbox.grant_runtime(identity, [str(workspace / "check.sh")])
    assert granted and not any(secret.parent in p.parents or p == secret for p in granted)
    granted.clear()
    sandbox.grant_runtime(identity, ["sh"])  # a program outside its folders is still opened to it
    assert any(p.name == "sh" or "sh" in p.name for p in granted)


def test_a_judge_installed_only_where_executions_run_loads(folder: Path) -> None:
    """On a cluster the driver that loads the file may lack a judge the workers have: only its form is
    checked at load; whether it starts is asked before each try (an invalid try where it cannot)."""
    for program in ("no-such-judge", "/no/such/judge"):
        task = _task(evaluator={"score": "exit-code", "command": [program, "{workspace}"]})
        (loaded,) = load_task_file(_write(folder / "t.jsonl", json.dumps(task)))
        assert loaded.evaluate.command[0] == program


def test_a_workspace_program_the_agent_removed_scores_what_it_gives(exec_tmp: Path) -> None:
    """An evaluator that runs `{workspace}/run_tests.sh`: the agent deleting it is the agent's result
    (exit-code 0.0), not a try without a score (which would drop the execution)."""
    task = {"id": "w", "prompt": "p", "files": {"run_tests.sh": "#!/bin/sh\nexit 0\n"},
            "evaluator": {"score": "exit-code", "command": ["{workspace}/run_tests.sh"]}}  # fmt: skip
    (loaded,) = load_task_file(_write(exec_tmp / "tasks/w.jsonl", json.dumps(task)))
    out = _run(loaded, exec_tmp, "import os\nos.remove('run_tests.sh')\n", timeout_s=30)
    assert out.valid and out.reward == 0.0, out
