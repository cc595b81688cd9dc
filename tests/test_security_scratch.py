"""Security: what an execution leaves in shared scratch (world-writable folders, SysV IPC) is gone for
the next holder of its uid, counts against its limits, and hidden tests in a git worktree are closed."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from security_cases import NOWHERE, needs_root, py
from security_cases import task as make_task

from gyre_ray.agents.runner import run_execution
from gyre_ray.agents.sandbox import Limits, close_hidden_tests

# ---- what an execution leaves outside /tmp, /var/tmp, /dev/shm reaches the next holder of its uid ---

SHM_KEY = 0x6A7E0A11
LOCK_FILE = Path("/run/lock/gyre-security-audit-left")
LEAVE = r"""
import ctypes, os
print("UID", os.getuid())
try:
    open(LOCK_PATH, "w").write("A-SECRET")
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(SHM_KEY_VALUE, 4096, 0o1000 | 0o600)
ctypes.memmove(libc.shmat(shmid, None, 0), b"A-SHM-SECRET", 12)
""".replace("LOCK_PATH", repr(str(LOCK_FILE))).replace("SHM_KEY_VALUE", str(SHM_KEY))
FIND = r"""
import ctypes, json, os
found = {}
try:
    found["file"] = open(LOCK_PATH).read()
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(SHM_KEY_VALUE, 0, 0)
if shmid >= 0:
    found["shm"] = ctypes.string_at(libc.shmat(shmid, None, 0), 12).decode()
print("UID", os.getuid())
print("FOUND " + json.dumps(found))
""".replace("LOCK_PATH", repr(str(LOCK_FILE))).replace("SHM_KEY_VALUE", str(SHM_KEY))


def _remove_shm(key: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(key, 0, 0)
    if shmid >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


@needs_root
def test_what_an_execution_leaves_outside_the_scratch_folders_is_gone_for_the_next_holder(
    exec_tmp: Path,
) -> None:
    # SHOWS: `reclaim` removes only what the uid owns under /tmp, /var/tmp and /dev/shm; a file in
    # /run/lock (world-writable) and a SysV shared-memory segment survive, and the next execution that
    # draws the same pool uid reads them (docs: "the next execution with the same uid reads nothing").
    # Fix: also sweep every world-writable folder (find -xdev -perm -0002) and the uid's SysV IPC
    # (ipcrm / shmctl IPC_RMID for every object it owns); better, private /tmp and IPC namespaces.
    try:
        a = run_execution(
            "A", make_task(), NOWHERE, exec_tmp / "workspaces" / "A", command=py(LEAVE), timeout_s=30
        )
        for _ in range(10):  # B must draw A's uid: a neighbour holding that slot sends it elsewhere
            b = run_execution(
                "B", make_task(), NOWHERE, exec_tmp / "workspaces" / "B", command=py(FIND), timeout_s=30
            )
            if b.log_tail.split("UID ", 1)[1].split()[0] == a.log_tail.split("UID ", 1)[1].split()[0]:
                break
            time.sleep(0.5)
    finally:
        LOCK_FILE.unlink(missing_ok=True)
        _remove_shm(SHM_KEY)
    uid_a = a.log_tail.split("UID ", 1)[1].split()[0]
    uid_b = b.log_tail.split("UID ", 1)[1].split()[0]
    if uid_a != uid_b:
        pytest.skip("the two executions drew different pool uids (another execution held the slot)")
    found = json.loads(b.log_tail.split("FOUND ", 1)[1].splitlines()[0])
    assert found == {}, found


# ---- writes to shared scratch escape the disk (and memory) limits -----------------------------------

FILL_SCRATCH = r"""
import os, time
for root in ("/dev/shm", "/var/tmp"):
    os.makedirs(f"{root}/gyre-audit-fill", exist_ok=True)
    for i in range(10):
        open(f"{root}/gyre-audit-fill/f{i}", "wb").write(b"x" * (3 << 20))
print("WROTE 60 MiB outside its folders")
time.sleep(2)
"""


@needs_root
def test_writes_to_shared_scratch_count_against_the_executions_limits(exec_tmp: Path) -> None:
    # SHOWS: `supervise` watches disk only in [workspace, HOME, TMPDIR]; an agent writes 60 MiB into
    # /dev/shm and /var/tmp with max_disk_mb=8 and max_memory_mb=200 and is not stopped (tmpfs pages
    # are not resident memory of any process either), so it can fill the host's RAM (/dev/shm) or
    # disk while the job runs. Fix: count the uid's files under the scratch folders in the disk
    # watch, or give each execution private, size-limited /tmp and /dev/shm (mount namespace).
    out = run_execution(
        "F", make_task(), NOWHERE, exec_tmp / "workspaces" / "F", command=py(FILL_SCRATCH), timeout_s=30,
        limits=Limits(max_file_mb=4, max_disk_mb=8, max_memory_mb=200),
    )  # fmt: skip
    assert not ("WROTE 60 MiB" in out.log_tail and "limit" not in out.reason), (out.reason, out.log_tail)


# ---- hidden tests in a git worktree ------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_hidden_tests_in_a_git_worktree_have_their_repository_closed(tmp_path: Path) -> None:
    # SHOWS: `close_hidden_tests` closes `.git` only when it is a folder; in a worktree (or
    # submodule) `.git` is a file naming the real repository, which is left open (0755): a sandbox
    # uid reads the hidden tests with `git -c safe.directory=* --git-dir=<main>/.git show
    # HEAD:hidden/...` (and from the main checkout's copy). Fix: follow the `gitdir:`/commondir of a
    # `.git` file and close that repository (or refuse hidden tests inside a worktree).
    env = {**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}  # fmt: skip
    main = tmp_path / "main"
    (main / "hidden").mkdir(parents=True)
    (main / "hidden" / "test_x.py").write_text("def test_x():\n    assert 1\n")
    os.chmod(tmp_path, 0o755)
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["commit", "-qm", "init"],
        ["worktree", "add", "-q", str(tmp_path / "wt")],
    ):
        subprocess.run(["git", "-C", str(main), *args], check=True, capture_output=True, env=env)
    os.chmod(main / ".git", 0o755)
    close_hidden_tests([tmp_path / "wt" / "hidden"])
    assert (main / ".git").stat().st_mode & 0o077 == 0, oct((main / ".git").stat().st_mode)


# ---- a private /tmp, /dev/shm, ... where the run folder is elsewhere ---------------------------------

USE_SCRATCH = r"""
import os
print("SEES", sorted(os.listdir("/dev/shm")))
print("SHMMAX", open("/proc/sys/kernel/shmmax").read().strip())
open("/dev/shm/gyre-private-mark", "w").write("x")
try:
    open("/dev/shm/gyre-private-big", "wb").write(b"x" * (12 << 20))
    print("BIG WRITTEN")
except OSError as exc:
    print("BIG REFUSED", exc.errno)
"""


@needs_root
def test_an_execution_gets_scratch_folders_of_its_own() -> None:
    """The harness's /dev/shm (like /tmp, /var/tmp, ... where no folder it needs lies: a checkout under
    /tmp keeps the shared /tmp) is its own tmpfs, as large as its disk limit: it sees nothing of the
    machine's, and what it writes there is gone after it."""
    base = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/var/lib"))
    try:
        out = run_execution(
            "P", make_task(), NOWHERE, base / "workspaces" / "P", command=py(USE_SCRATCH), timeout_s=30,
            limits=Limits(max_file_mb=64, max_disk_mb=8, max_memory_mb=500),
        )  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    seen = json.loads(out.log_tail.split("SEES ", 1)[1].splitlines()[0].replace("'", '"'))
    assert seen == [], out.log_tail  # the machine's /dev/shm is not there
    assert "BIG REFUSED 28" in out.log_tail, out.log_tail  # ENOSPC: 8 MiB of its own
    assert (
        f"SHMMAX {500 << 20}" in out.log_tail
    )  # its own SysV IPC, shared memory bounded by its memory limit
    assert not Path("/dev/shm/gyre-private-mark").exists()


def test_the_job_never_opens_a_fifo_or_link_the_execution_left_as_its_log(tmp_path: Path) -> None:
    """The evaluator log lies in a folder the execution owns: a FIFO there would block the job's open."""
    from gyre_ray.agents.supervise import open_log

    fifo = tmp_path / "evaluator.log"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="No such device|not a regular file"):  # at once: ENXIO, no reader
        open_log(fifo)
    (tmp_path / "target").write_text("")
    (tmp_path / "linked.log").symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        open_log(tmp_path / "linked.log")
    fd = open_log(tmp_path / "fresh.log")
    os.write(fd, b"ok")
    os.close(fd)
    assert (tmp_path / "fresh.log").read_bytes() == b"ok" and (
        tmp_path / "fresh.log"
    ).stat().st_mode & 0o777 == 0o600


WITHOUT_MOUNTS = r"""
import sys, tempfile
from pathlib import Path
from security_cases import NOWHERE, py, task
from gyre_ray.agents.runner import run_execution
from gyre_ray.agents.sandbox import Limits, private_mounts_work
fill = "open('/dev/shm/gyre-shared-fill', 'wb').write(b'x' * (40 << 20)); import time; time.sleep(5)"
base = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/var/lib"))
out = run_execution("nomount", task(), NOWHERE, base / "ws", command=py(fill), timeout_s=60,
                    limits=Limits(max_disk_mb=24))
import shutil; shutil.rmtree(base, ignore_errors=True)
print("WORKS", private_mounts_work(), "REASON", out.reason)
"""


@needs_root
def test_a_host_refusing_private_mounts_has_shared_scratch_watched() -> None:
    """A pod without CAP_SYS_ADMIN refuses the wrapper's mounts, so /dev/shm and the like stay shared:
    the job learns it before the first execution and watches them (it took them as private, so 40 MiB
    written to the shared /dev/shm passed a 24 MiB disk limit unseen)."""
    done = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", WITHOUT_MOUNTS],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "WORKS False REASON killed at its disk limit (24 MiB)" in done.stdout, (
        done.stdout + done.stderr[-2000:]
    )
    assert "private scratch folders are not available here" in done.stderr
    assert not Path("/dev/shm/gyre-shared-fill").exists()  # swept at reclaim


def _swept_roots(monkeypatch) -> list[tuple[str, ...]]:
    """The roots each reclaim sweeps, recorded (the sweep itself still runs)."""
    import gyre_ray.agents.sandbox as sandbox_module

    swept, real = [], sandbox_module.remove_scratch

    def recording(uid: int, roots: tuple[str, ...] | None = None, gid: int | None = None) -> None:
        swept.append(roots)
        real(uid, roots, gid)

    monkeypatch.setattr(sandbox_module, "remove_scratch", recording)
    return swept


@needs_root
def test_reclaim_sweeps_only_the_scratch_folders_an_execution_shared(monkeypatch, exec_tmp: Path) -> None:
    """Sweeping walks all a busy /tmp holds (0.5 s of CPU per execution here, three quarters of the default
    job's time with a checkout's .venv under /tmp): a /tmp the execution had as its own tmpfs is not swept,
    its run folder under /tmp or not; one it shared (a host refusing the mounts) still is."""
    swept = _swept_roots(monkeypatch)
    base = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/var/lib"))
    try:
        out = run_execution("own", make_task(), NOWHERE, base / "ws", command=py("pass"), timeout_s=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.exit_code == 0 and None not in swept  # swept nothing, or a shared /dev/mqueue alone
    assert not any({"/tmp", "/var/tmp", "/dev/shm", "/run/lock"} & set(roots) for roots in swept), swept
    out = run_execution("under", make_task(), NOWHERE, exec_tmp / "ws", command=py("pass"), timeout_s=60)
    assert out.exit_code == 0 and not any("/tmp" in roots for roots in swept), swept  # /tmp/...: private too
    import gyre_ray.agents.supervise as supervise_module

    monkeypatch.setattr(supervise_module, "private_mounts_work", lambda: False)  # a host refusing mounts
    out = run_execution("shared", make_task(), NOWHERE, exec_tmp / "ws2", command=py("pass"), timeout_s=60)
    assert out.exit_code == 0 and {"/tmp", "/dev/shm"} <= set(swept[-1]), swept


MOUNTS_FAIL_LATE = r"""
import tempfile, shutil
from pathlib import Path
from security_cases import NOWHERE, py, task
import gyre_ray.agents.supervise as supervise_module
from gyre_ray.agents.runner import run_execution
from gyre_ray.agents.sandbox import Limits
supervise_module.private_mounts_work = lambda: True  # the probe passed; this execution's mounts fail
leave = "open('/dev/shm/gyre-left-unswept', 'w').write('x')"
fill = "open('/dev/shm/gyre-late-fill', 'wb').write(b'x' * (40 << 20)); import time; time.sleep(5)"
base = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/var/lib"))
out = run_execution("late", task(), NOWHERE, base / "ws", command=py(leave), timeout_s=60)
filled = run_execution("fill", task(), NOWHERE, base / "ws2", command=py(fill), timeout_s=60,
                       limits=Limits(max_disk_mb=24))
shutil.rmtree(base, ignore_errors=True)
print("EXIT", out.exit_code, "WARNED", "private /proc, /tmp and IPC incomplete" in out.log_tail)
print("FILLED", filled.reason)
"""


@needs_root
def test_an_execution_whose_private_mounts_failed_has_its_scratch_swept() -> None:
    """The wrapper reports whether its mounts are in place; where they failed (after the job's probe
    passed) the folders taken as private were shared: what the execution left there is swept, and what
    it writes there counts toward its disk limit (40 MiB in the shared /dev/shm passed 24 MiB unseen)."""
    done = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", MOUNTS_FAIL_LATE],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    left = Path("/dev/shm/gyre-left-unswept")
    try:
        assert "EXIT 0 WARNED True" in done.stdout, done.stdout + done.stderr[-2000:]
        assert "FILLED killed at its disk limit (24 MiB)" in done.stdout, done.stdout
        assert not left.exists() and not Path("/dev/shm/gyre-late-fill").exists()
    finally:
        left.unlink(missing_ok=True)
        Path("/dev/shm/gyre-late-fill").unlink(missing_ok=True)


UNDER_TMP = r"""
import os
marker = "@PATH@"
print("SEES MARKER", os.path.exists(marker))
open("/tmp/gyre-private-under", "w").write("x")
open("mine.txt", "w").write("kept")
try:
    open(os.path.join(os.path.dirname(os.getcwd()), "beside.txt"), "w").write("x")
    print("BESIDE WRITTEN")
except OSError as exc:
    print("BESIDE REFUSED", exc.errno)
"""


@needs_root
def test_a_run_folder_under_tmp_gets_a_private_tmp_with_its_folders_bound_in(exec_tmp: Path) -> None:
    """A run folder under /tmp kept the whole shared /tmp (readable, walked, swept). Now /tmp is its own
    tmpfs with what it needs bound back in: its workspace writable, the rest of that entry read-only,
    nothing else of the machine's /tmp there."""
    marker = Path(tempfile.mkdtemp(prefix="gyre-shared-marker-", dir="/tmp"))
    os.chmod(marker, 0o755)
    workspace = exec_tmp / "ws"
    try:
        out = run_execution(
            "under",
            make_task(),
            NOWHERE,
            workspace,
            command=py(UNDER_TMP.replace("@PATH@", str(marker))),
            timeout_s=60,
        )
    finally:
        shutil.rmtree(marker, ignore_errors=True)
    assert out.exit_code == 0, out.log_tail
    assert "SEES MARKER False" in out.log_tail, out.log_tail  # the machine's /tmp is not there
    assert "BESIDE REFUSED" in out.log_tail, out.log_tail
    assert (workspace / "mine.txt").read_text() == "kept"  # its workspace is the real one
    assert not Path("/tmp/gyre-private-under").exists()  # what it wrote in /tmp was its own
    assert not (exec_tmp / "beside.txt").exists()
