"""Security: an execution's folders go back to the job whatever it left in them (a path past PATH_MAX, a
tree 1000 folders deep) and whatever became of its executor (one that died holds them no longer once
its uid runs again), what it writes there counts toward its disk limit, and `agents.workspace_root` is a
folder the job may trust."""

from __future__ import annotations

import errno
import inspect
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from security_cases import NOWHERE, needs_root, py
from security_cases import task as make_task

import gyre_ray.agents.sandbox as sandbox
from gyre_ray.agents.runner import run_execution
from gyre_ray.agents.sandbox import (
    USER_PREFIX,
    Identity,
    Limits,
    SandboxError,
    acquire_identity,
    disk_mb,
    prepare_folders,
    reclaim,
    secure_workspace_root,
)
from gyre_ray.envs.task_scoring import CommandEvaluator

as_root = pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true", reason="needs root to own files as another uid"
)


def chain(top, name, depth, payload_mb=0):
    import os

    fd = os.open(top, os.O_RDONLY)  # by descriptor: no path is ever longer than one name
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    out = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    for _ in range(payload_mb):
        os.write(out, b"x" * (1 << 20))
    os.close(out)
    os.close(fd)


CHAIN = inspect.getsource(chain)  # (for the executions' commands: `depth` folders named `name`, a leaf)
LONG = ("d" * 200, 22)  # 22 levels of 200-char names: a path past PATH_MAX (4096)
DEEP = ("a", 1100)  # past Python 3.11's recursion limit in os.walk and shutil.rmtree


@pytest.fixture
def deep_tmp() -> Iterator[Path]:
    """A folder for executions that leave trees shutil.rmtree cannot remove on Python 3.11 (removed
    with rm, which walks any depth), traversable by the sandbox group as `exec_tmp` is."""
    path = Path(tempfile.mkdtemp(prefix="gyre-exec-test-"))
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


@pytest.fixture
def var_tmp() -> Iterator[Path]:
    """A folder for executions outside /tmp (where a job's run folder usually is)."""
    path = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/var/lib"))
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def _not_the_jobs(folder: Path) -> str:
    """What under `folder` (itself included, at any depth) is not root's; find walks past PATH_MAX."""
    done = subprocess.run(
        ["find", str(folder), "(", "!", "-uid", "0", "-o", "!", "-gid", "0", ")", "-printf", "%u %P\n"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-500:]
    return done.stdout[:500]


def _judge(hidden: Path, code: str = "") -> CommandEvaluator:
    """A json judge (run as the execution's uid) that runs `code` with `chain` and SCRATCH defined, then
    scores 1.0."""
    hidden.mkdir()
    (hidden / "judge.py").write_text(
        f"import sys\nSCRATCH = sys.argv[1]\n{CHAIN}\n{code}\nprint('{{\"score\": 1.0}}')\n"
    )
    return CommandEvaluator("json", (sys.executable, "{hidden}/judge.py", "{scratch}"), hidden)


# ---- 1. a path past PATH_MAX, a tree 1000 folders deep ------------------------------------------------


def test_disk_use_past_path_max_is_counted(tmp_path: Path) -> None:
    """os.walk skipped a folder whose path passes PATH_MAX: 3 MiB there counted as nothing."""
    chain(tmp_path, *LONG, payload_mb=3)
    assert disk_mb([tmp_path]) >= 3.0


def test_a_tree_1000_folders_deep_is_measured_and_removed(deep_tmp: Path) -> None:
    """os.walk and shutil.rmtree recurse: on Python 3.11 a tree 1100 folders deep raised RecursionError."""
    from gyre_ray.agents.scratch import remove_tree, tree_entries

    chain(deep_tmp, *DEEP)
    chain(deep_tmp / "a", *LONG)
    before, most, count = len(os.listdir("/proc/self/fd")), 0, 0
    for _ in tree_entries(deep_tmp):
        count += 1
        most = max(most, len(os.listdir("/proc/self/fd")))
    assert count == DEEP[1] + 1 + LONG[1] + 1
    assert most - before < 40  # not a descriptor per level (ulimit -n is often 1024)
    remove_tree(deep_tmp / "a")
    assert os.listdir(deep_tmp) == []


def test_a_disk_measure_that_fails_counts_as_over_the_limit(tmp_path: Path, monkeypatch) -> None:
    """A measure that raised ended the disk watch's thread (the limit went unchecked), or, in the
    measure taken as the command started, the command (each evaluator try)."""
    import gyre_ray.agents.supervise as supervise_module

    me = Identity(os.geteuid(), os.getegid(), "me", dedicated=False)
    calls = {"n": 0}

    def fails_after(first_ok: bool):
        def measure(folders: list[Path]) -> float:
            calls["n"] += 1
            if first_ok and calls["n"] == 1:
                return 0.0
            raise RecursionError("maximum recursion depth exceeded")

        return measure

    for first_ok in (True, False):
        calls["n"] = 0
        monkeypatch.setattr(supervise_module, "disk_mb", fails_after(first_ok))
        watch = supervise_module._DiskWatch([tmp_path], 10, me)
        watch.start()
        try:
            deadline = time.monotonic() + 10
            while not watch.over() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watch.over().startswith("disk limit (10 MiB)"), first_ok
            assert all(part.thread.is_alive() for part in watch.parts)  # still watching
        finally:
            watch.stop()


LEAVE_LONG = (
    CHAIN
    + r"""
import os
for top in (".", os.environ["HOME"], os.environ["TMPDIR"]):
    chain(top, "LONG", 22)
os.chmod(os.environ["HOME"], 0o755)  # opened to all: handed back closed again
print("LEFT", flush=True)
chain(".", "MORE", 22, 40)  # 40 MiB at the end of a path past PATH_MAX (killed while it writes)
import time; time.sleep(8)
""".replace("LONG", "d" * 200).replace("MORE", "e" * 200)
)


@needs_root
def test_a_path_past_path_max_counts_toward_the_disk_limit_and_is_handed_back(deep_tmp: Path) -> None:
    """An execution left 22 levels of 200-char folder names in its workspace, HOME, TMPDIR and evaluator
    folder: the 40 MiB at the end went uncounted (no disk limit), and handing the folders back raised
    ENAMETOOLONG out of `reclaim` (the outcome lost: "execution could not run: OSError") at the first
    folder, leaving the others, hidden tests' copy included, to the pool uid for its next holder."""
    workspace = deep_tmp / "workspaces" / "L"
    judge = _judge(deep_tmp / "hidden", f"chain(SCRATCH, {'d' * 200!r}, 22)")
    out = run_execution(
        "L", make_task(evaluate=judge), NOWHERE, workspace, command=py(LEAVE_LONG), timeout_s=60,
        limits=Limits(max_file_mb=64, max_disk_mb=24), eval_budget_s=30,
    )  # fmt: skip
    assert "LEFT" in out.log_tail, out.log_tail
    assert out.reason == "killed at its disk limit (24 MiB)", (out.reason, out.log_tail)  # (measured)
    assert out.valid and out.reward == 1.0, (out.reason, out.detail)
    for name in ("L", "L.home", "L.tmp", "L.eval"):
        folder = workspace.parent / name
        assert folder.is_dir() and _not_the_jobs(folder) == "", (name, _not_the_jobs(folder))
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, name


LEAVE_DEEP = (
    CHAIN
    + r"""
chain(".", "a", 1100)
print("DEEP", flush=True)
import time; time.sleep(1.5)
open("fill", "wb").write(b"x" * (40 << 20))
print("FILLED", flush=True)
time.sleep(8)
"""
)


@needs_root
def test_a_tree_1000_folders_deep_does_not_end_the_disk_watch(deep_tmp: Path) -> None:
    """The disk watch's walk raised RecursionError in its thread once the tree was 1000 deep: the thread
    ended, silently, and 40 MiB written next passed a 24 MiB limit."""
    out = run_execution(
        "D", make_task(), NOWHERE, deep_tmp / "workspaces" / "D", command=py(LEAVE_DEEP), timeout_s=60,
        limits=Limits(max_file_mb=64, max_disk_mb=24), eval_budget_s=10,
    )  # fmt: skip
    assert "DEEP" in out.log_tail, out.log_tail
    assert out.reason == "killed at its disk limit (24 MiB)", (out.reason, out.log_tail)  # (measured)
    assert _not_the_jobs(deep_tmp / "workspaces" / "D") == ""


@needs_root
def test_a_tree_1000_folders_deep_does_not_fail_every_evaluator_try(deep_tmp: Path) -> None:
    """Each evaluator try measured the folders' disk use as its command started: RecursionError, so
    every try failed and the execution was dropped; handing the folders back raised it too."""
    judge = _judge(deep_tmp / "hidden", "chain(SCRATCH, 'a', 1100)")
    leave = CHAIN + "\nchain('.', 'a', 1100)\nprint('DEEP', flush=True)\n"
    workspace = deep_tmp / "workspaces" / "E"
    out = run_execution(
        "E", make_task(evaluate=judge), NOWHERE, workspace, command=py(leave), timeout_s=60, eval_budget_s=10
    )
    assert "DEEP" in out.log_tail, out.log_tail
    assert out.valid and out.reward == 1.0, (out.reason, out.detail)
    for name in ("E", "E.eval"):
        assert _not_the_jobs(workspace.parent / name) == "", name


@as_root
def test_a_deep_tree_a_uid_left_in_shared_scratch_is_removed(deep_tmp: Path) -> None:
    from gyre_ray.agents.scratch import remove_scratch

    shared = deep_tmp / "tmp"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)
    left = shared / "left"
    left.mkdir()
    chain(left, *DEEP)
    chain(left, *LONG)
    uid = 54321
    subprocess.run(["chown", "-R", str(uid), str(left)], check=True)
    remove_scratch(uid, (str(shared),))
    assert os.listdir(shared) == []


def _slot_lock(identity: Identity) -> Path:
    return sandbox.LOCK_DIR / f"slot-{identity.name.removeprefix(USER_PREFIX)}.lock"


def _draw(uid: int, tries: int = 8, rounds: int = 20) -> Identity | None:
    """The pool identity of `uid`, drawn again (slots are taken first free: at once unless a neighbour
    took it meanwhile, then again once the neighbour's execution ended, up to `rounds` half-second
    waits), or None; the others drawn on the way are given back."""
    for attempt in range(rounds):
        drawn, found = [], None
        try:
            for _ in range(tries):
                identity = acquire_identity("user")
                if identity.uid == uid:
                    found = identity
                    break
                drawn.append(identity)
        finally:
            for other in drawn:
                reclaim(other)
        if found is not None or attempt == rounds - 1:
            return found
        time.sleep(0.5)
    return None


@needs_root
def test_reclaim_hands_back_each_folder_past_one_that_fails(exec_tmp: Path, monkeypatch) -> None:
    """An error handing back one folder escaped `reclaim` (replacing the execution's outcome) and left
    the folders after it to the pool uid; now each folder is handed back on its own, and the slot stays
    marked so that its next holder takes back the one that failed before anything runs as the uid."""
    folders = [exec_tmp / name for name in ("w", "w.home", "w.tmp")]
    identity = acquire_identity("user")
    uid = identity.uid
    prepare_folders(identity, *folders)
    assert all(folder.stat().st_uid == uid for folder in folders)
    real = sandbox._chown_tree

    def failing(root, *args, **kwargs):
        if Path(root) == folders[0]:
            raise OSError(errno.ENAMETOOLONG, "File name too long")
        return real(root, *args, **kwargs)

    monkeypatch.setattr(sandbox, "_chown_tree", failing)
    reclaim(identity)  # no error
    assert [folder.stat().st_uid for folder in folders] == [uid, 0, 0]
    assert _slot_lock(identity).stat().st_size > 0  # marked: not clean
    monkeypatch.undo()
    again = _draw(uid)
    if again is None:
        pytest.skip("a neighbour drew the slot first")
    try:
        assert folders[0].stat().st_uid == 0  # taken back before the uid's next holder ran anything
    finally:
        reclaim(again)
    assert _slot_lock(identity).stat().st_size == 0


# ---- 2. an executor that died mid-execution ------------------------------------------------------------

DIES_WHILE_JUDGING = r"""
import os, sys
from pathlib import Path
from security_cases import NOWHERE, py, task
from gyre_ray.agents.runner import run_execution

def judge(workspace, ctx):
    hidden = ctx.scratch / "hidden"  # as the evaluator copies the hidden tests: readable by the uid
    hidden.mkdir(mode=0o755)
    (hidden / "test_secret.py").write_text("HIDDEN-TESTS")
    os.chmod(hidden / "test_secret.py", 0o644)
    os._exit(7)  # the executor dies while judging: no reclaim

judge.needs_context = True
leave = "import os; open(os.path.expanduser('~/secret.txt'), 'w').write('HOME-SECRET'); open('work.txt', 'w').write('WORK')"
run_execution("A", task(evaluate=judge), NOWHERE, Path(sys.argv[1]), command=py(leave), timeout_s=30)
"""
READ_LEFT = r"""
import json, os
found = {}
for path in PATHS:
    try:
        found[path] = open(path).read()
    except OSError:
        pass
print("UID", os.getuid())
print("FOUND " + json.dumps(found))
"""


@needs_root
def test_the_folders_of_an_execution_whose_executor_died_are_taken_back_before_its_uid_runs_again(
    var_tmp: Path,
) -> None:
    """An executor died while judging: its execution's workspace, HOME, TMPDIR and evaluator folder (with
    the hidden tests' copy) stayed the pool uid's, and the relaunch `r1.<id>`, drawing the same first
    free slot, read them all. The slot's lock file now names the folders; its next holder hands them
    back to the job first. (The run folder is outside /tmp, as a job's is: under a shared /tmp the
    sweep of what the uid owns there removed some of it.)"""
    exec_tmp = var_tmp
    workspace = exec_tmp / "workspaces" / "A"
    done = subprocess.run(
        [sys.executable, "-c", DIES_WHILE_JUDGING, str(workspace)], cwd=Path(__file__).parent,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 7, done.stderr[-2000:]
    uid = workspace.stat().st_uid
    assert uid != 0 and (exec_tmp / "workspaces" / "A.eval" / "hidden" / "test_secret.py").exists()
    paths = [
        str(workspace / "work.txt"),
        str(exec_tmp / "workspaces" / "A.home" / "secret.txt"),
        str(exec_tmp / "workspaces" / "A.eval" / "hidden" / "test_secret.py"),
    ]
    for _ in range(10):  # a neighbour holding the slot takes the relaunch elsewhere: once it is free again
        out = run_execution(
            "r1.A", make_task(), NOWHERE, exec_tmp / "workspaces" / "r1.A",
            command=py(READ_LEFT.replace("PATHS", repr(paths))), timeout_s=30,
        )  # fmt: skip
        if f"UID {uid}\n" in out.log_tail:
            break
        time.sleep(0.5)
    if f"UID {uid}\n" not in out.log_tail:
        pytest.skip("the relaunch drew another pool uid (a neighbour held the slot)")
    found = json.loads(out.log_tail.split("FOUND ", 1)[1].splitlines()[0])
    assert found == {}, found
    for name in ("A", "A.home", "A.tmp", "A.eval"):
        assert _not_the_jobs(exec_tmp / "workspaces" / name) == "", name


# ---- 3. agents.workspace_root ------------------------------------------------------------------------


def test_a_sticky_workspace_root_is_left_as_it_is(tmp_path: Path) -> None:
    """With agents.workspace_root=/tmp and the job root, /tmp was chmodded 0711: the machine's /tmp lost
    its sticky bit (and everyone's write access). A sticky folder (of the job's or root's) is kept."""
    root = tmp_path / "sticky"
    root.mkdir()
    os.chmod(root, 0o1777)
    secure_workspace_root(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o1777


@as_root
def test_a_workspace_root_someone_else_owns_is_refused(tmp_path: Path) -> None:
    """A folder another user owns was accepted when the job is root (a world-writable one chmodded, its
    owner kept: who could open it again, or rename the run's folder in it). Refused, however open."""
    for mode in (0o777, 0o755, 0o1777):
        root = tmp_path / f"theirs-{mode:o}"
        root.mkdir()
        os.chmod(root, mode)
        os.chown(root, 54321, 54321)
        with pytest.raises(SandboxError, match="not to the job"):
            secure_workspace_root(root)
        assert stat.S_IMODE(root.stat().st_mode) == mode  # untouched
