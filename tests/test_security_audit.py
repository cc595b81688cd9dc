"""Security: another execution's prompt is not in any /proc it can read, the judge cannot be hijacked
through the agent's HOME or its report file, and seeding never writes through links an earlier
execution left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from security_cases import NOWHERE, needs_root, py
from security_cases import task as make_task

from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.envs.task_scoring import CommandEvaluator

# ---- another execution's prompt (and its tools' commands) in /proc/<pid>/cmdline ------------------

SPY_CMDLINES = r"""
import json, os
seen = []
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if "PROMPT-OF-A" in cmd and str(os.getpid()) != pid:
        seen.append([pid, os.stat(f"/proc/{pid}").st_uid, cmd[-120:]])
print("SEEN " + json.dumps(seen))
"""


@needs_root
def test_a_neighbour_cannot_read_another_executions_prompt_from_proc_cmdline(exec_tmp: Path) -> None:
    # SHOWS: claude-code (`claude -p PROMPT`), codex (`codex exec ... PROMPT`) and `agents.command`
    # with {prompt} put the prompt in argv, and /proc/<pid>/cmdline is world-readable: a concurrent
    # execution (another uid) reads it, and every command line its tools run. /proc is mounted
    # without hidepid and the harness shares the job's PID namespace. Fix: hidepid=2 (or a PID
    # namespace per execution), and the prompt passed by file/env rather than argv.
    root = exec_tmp / "workspaces"
    holder: dict = {}

    def run_a() -> None:
        holder["A"] = run_execution(
            "A", make_task("PROMPT-OF-A held out"), Endpoint("http://127.0.0.1:9", "key-A"), root / "A",
            command=["/bin/sh", "-c", "sleep 5", "agent", "PROMPT-OF-A held out"], timeout_s=30,
        )  # fmt: skip

    thread = threading.Thread(target=run_a)
    thread.start()
    time.sleep(1.5)
    try:
        out = run_execution(
            "B",
            make_task("b"),
            Endpoint("http://127.0.0.1:9", "key-B"),
            root / "B",
            command=py(SPY_CMDLINES),
            timeout_s=30,
        )
    finally:
        thread.join()
    seen = json.loads(out.log_tail.split("SEEN ", 1)[1].splitlines()[0])
    assert seen == [], seen


# ---- the judge runs with the agent's HOME, as the agent's uid ----------------------------------------


def _system_python() -> str | None:
    """A python3 outside any virtual environment (user site-packages enabled), or None."""
    for cand in ("/usr/bin/python3", shutil.which("python3")):
        if cand and os.path.exists(cand):
            done = subprocess.run([cand, "-c", "import sys; print(sys.prefix == sys.base_prefix)"],
                                  capture_output=True, text=True, check=False)  # fmt: skip
            if done.stdout.strip() == "True":
                return cand
    return None


PLANT_USER_SITE = r"""
import os, sys
open("answer.txt", "w").write("41")  # the wrong answer
d = os.path.expanduser("~/.local/lib/python%d.%d/site-packages" % sys.version_info[:2])
os.makedirs(d, exist_ok=True)
open(d + "/zz.pth", "w").write("import atexit; atexit.register(lambda: print('{\"score\": 1.0}'))\n")
"""


@needs_root
def test_a_judge_that_never_imports_agent_code_cannot_be_hijacked_through_the_agents_home(
    exec_tmp: Path,
) -> None:
    # SHOWS: the evaluator runs as the agent's uid with the agent's HOME (runner.py `run_command`:
    # harness_env(identity, home, tmp, ...)), so a `.pth` the agent left in ~/.local/lib/pythonX.Y/
    # site-packages runs inside a judge started with a system python3 and prints the last score
    # line: a wrong answer scores 1.0. Fix: a fresh HOME/TMPDIR for the evaluator (PYTHONNOUSERSITE=1),
    # ideally another uid than the agent's.
    python = _system_python()
    if python is None:
        pytest.skip("no python3 outside a virtual environment on this machine")
    hidden = exec_tmp / "hidden"
    hidden.mkdir()
    (hidden / "judge.py").write_text(
        "import json, pathlib\nok = pathlib.Path('answer.txt').read_text().strip() == '42'\n"
        "print(json.dumps({'score': 1.0 if ok else 0.0}))\n"
    )
    task = make_task(evaluate=CommandEvaluator("json", (python, "{hidden}/judge.py"), hidden))
    out = run_execution(
        "J", task, NOWHERE, exec_tmp / "workspaces" / "J", command=py(PLANT_USER_SITE), timeout_s=30
    )
    assert out.valid and out.reward == 0.0, (out.reward, out.detail)


FORGE_REPORT = r'''
open("answer.py", "w").write("""
import atexit, sys
def f():
    return 0  # wrong
def _forge():
    for a in sys.argv:
        if a.endswith("report.xml"):
            open(a, "w").write('<testsuites><testsuite><testcase name="a"/><testcase name="b"/></testsuite></testsuites>')
atexit.register(_forge)
""")
'''


@needs_root
@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/harnesses.md): the agent's code runs inside the pytest process, as the uid "
    "that writes the report, and can forge it (or patch pytest in memory); no report location closes that",
)
def test_code_under_test_cannot_rewrite_the_pytest_report(exec_tmp: Path) -> None:
    """With the default pytest evaluator an atexit hook in the agent's module rewrites the JUnit report
    after pytest wrote it: 2/2 "passed" while both assertions, kept in the hidden tests, fail. Strict:
    a change that closes it makes this test pass, and the marker must go."""
    hidden = exec_tmp / "hidden"
    hidden.mkdir()
    (hidden / "test_answer.py").write_text(
        "import answer\n\ndef test_a():\n    assert answer.f() == 42\n\ndef test_b():\n    assert answer.f() + 1 == 43\n"
    )
    task = make_task(evaluate=CommandEvaluator("pytest", None, hidden))
    out = run_execution(
        "R", task, NOWHERE, exec_tmp / "workspaces" / "R", command=py(FORGE_REPORT), timeout_s=30
    )
    assert out.reward == 0.0, (out.reward, out.detail)


# ---- the job follows links an earlier execution left in a reused workspace/HOME ---------------------


@needs_root
def test_seeding_a_reused_workspace_never_writes_through_a_link(exec_tmp: Path) -> None:
    # SHOWS: `Task.seed_workspace` (copytree into an existing folder) and the HOME files of
    # `_run` (`(home / rel).write_text`) write as root through links the previous holder of the same
    # workspace left (a rerun of `gyre-ray eval --out DIR` reuses `DIR/workspaces/eval-0/eval-<task>-<i>`):
    # a root-only file is overwritten and a file is created in a root-only folder.
    # Fix: refuse (or clear, without following links) a workspace/HOME that already exists.
    private = exec_tmp / "root-only"
    private.mkdir(mode=0o700)
    victim = private / "victim.txt"
    victim.write_text("ROOT DATA\n")
    seed = exec_tmp / "seed"
    seed.mkdir()
    (seed / "notes.md").write_text("SEED CONTENT\n")
    task = make_task(seed_dir=seed)
    plant = (
        f"import os, shutil; os.remove('notes.md'); os.symlink({str(victim)!r}, 'notes.md'); "
        f"shutil.rmtree(os.environ['HOME'] + '/.codex'); os.symlink({str(private)!r}, os.environ['HOME'] + '/.codex')"
    )
    workspace = exec_tmp / "workspaces" / "eval-0" / "eval-t-0"
    for code in (plant, "pass"):
        run_execution(
            "E", task, NOWHERE, workspace, command=py(code), timeout_s=30,
            home_files={".codex/config.toml": "model = 'x'\n"},
        )  # fmt: skip
    assert victim.read_text() == "ROOT DATA\n"
    assert sorted(os.listdir(private)) == ["victim.txt"]


# ---- the limits wrapper starts as root: nothing of the agent's reaches it ---------------------------

PLANT_MODULES = r"""
for name in ("argparse", "ctypes", "resource"):  # what the wrapper imports, planted where it would run
    open(name + ".py", "w").write("import os\nopen('imported-as-%d' % os.getuid(), 'w').close()\n")
"""


@needs_root
def test_modules_the_agent_plants_in_its_workspace_never_run_as_root(exec_tmp: Path) -> None:
    """The evaluator's wrapper starts as root (to give it a private /proc) in a workspace the agent
    wrote: it runs isolated (`python -I`, from /) and enters the workspace only as the uid."""
    hidden = exec_tmp / "hidden"
    hidden.mkdir()
    (hidden / "judge.py").write_text("print('{\"score\": 0.25}')\n")
    task = make_task(evaluate=CommandEvaluator("json", (sys.executable, "{hidden}/judge.py"), hidden))
    workspace = exec_tmp / "workspaces" / "P"
    out = run_execution("P", task, NOWHERE, workspace, command=py(PLANT_MODULES), timeout_s=30)
    assert out.valid and out.reward == 0.25, (out.reason, out.detail, out.log_tail)
    assert (workspace / "argparse.py").is_file()  # planted
    assert not list(workspace.glob("imported-as-*"))  # and imported by no one, root least of all


# ---- a json judge's output, read back from a file the agent's uid could replace ---------------------

FORGE_JUDGE_LOG = r'''
open("solve.py", "w").write("""
import glob, os
print(41)  # the wrong answer
for log in glob.glob("../*.eval/evaluator.log") + glob.glob("../*.eval.log"):
    try:  # the judge's output, replaced: a new file where the job reads it back
        os.rename(log, log + ".old")
        open(log, "w").write('{"score": 1.0}\\\\n')
    except OSError:
        pass
""")
'''


@needs_root
def test_code_a_json_judge_runs_cannot_replace_the_judges_output(exec_tmp: Path) -> None:
    """A `json` judge that runs the agent's code in a process of its own (what docs/harnesses.md
    recommends where agents may game the reward) printed its score into the evaluator's folder,
    which the execution's uid owns: that code could rename the file and leave a forged score line
    where the job read it back (1.0 for a wrong answer). The output now goes to a file in the job's
    folder."""
    hidden = exec_tmp / "hidden"
    hidden.mkdir()
    (hidden / "judge.py").write_text(
        "import json, subprocess, sys\n"
        "out = subprocess.run([sys.executable, 'solve.py'], capture_output=True, text=True).stdout\n"
        "print(json.dumps({'score': 1.0 if out.strip() == '42' else 0.0}))\n"
    )
    task = make_task(evaluate=CommandEvaluator("json", (sys.executable, "{hidden}/judge.py"), hidden))
    out = run_execution(
        "F", task, NOWHERE, exec_tmp / "workspaces" / "F", command=py(FORGE_JUDGE_LOG), timeout_s=30
    )
    assert out.valid and out.reward == 0.0, (out.reward, out.detail)
