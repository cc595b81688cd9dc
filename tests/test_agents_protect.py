"""What the job closes to sandbox users before executions run: Ray's token, every task's hidden
tests and the git repository holding them; what it removes after one: anything the uid left; and
the harnesses an executor that died left running."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from gyre_ray.agents.sandbox import (
    SandboxError,
    acquire_identity,
    close_hidden_tests,
    job_workspaces,
    kill_all,
    own_uids,
    protect_job_folders,
    protect_ray_credentials,
    reap_orphans,
    reclaim,
    secure_workspace_root,
)
from gyre_ray.agents.scratch import remove_scratch


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_rays_token_and_its_folder_are_closed_to_other_users(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    ray_dir = tmp_path / ".ray"
    ray_dir.mkdir(mode=0o755)
    token = ray_dir / "auth_token"
    token.write_text("t" * 64)
    token.chmod(0o644)  # as Ray 2.60 leaves it
    protect_ray_credentials(tmp_path)
    assert (_mode(ray_dir), _mode(token)) == (0o700, 0o600)
    elsewhere = tmp_path / "token"
    elsewhere.write_text("t")
    elsewhere.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(elsewhere))
    protect_ray_credentials(tmp_path / "no-home")
    assert _mode(elsewhere) == 0o600


def test_every_tasks_hidden_tests_and_their_git_repository_are_closed(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / ".git/objects").mkdir(parents=True)
    hidden = [repo / "tasks/hidden/a", repo / "tasks/hidden/b"]
    for folder in hidden:
        folder.mkdir(parents=True)
        folder.chmod(0o755)
    (repo / ".git").chmod(0o755)
    assert close_hidden_tests(hidden) == [repo / ".git"]
    assert [_mode(p) for p in [*hidden, repo / ".git"]] == [0o700, 0o700, 0o700]
    assert close_hidden_tests(hidden) == []  # already closed: nothing to do


# CI runs as root (the sandbox tests need it too, tests/test_agents_hostile.py): there it must run.
@pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true", reason="needs root to own files as another uid"
)
def test_files_a_uid_left_deep_in_shared_scratch_are_removed(tmp_path: Path) -> None:
    shared = tmp_path / "tmp/ray/session_1/logs"
    shared.mkdir(parents=True)
    for folder in (shared, shared.parent, shared.parent.parent):
        folder.chmod(0o777)  # as Ray leaves its session folders: anyone may write there
    mine, theirs = shared / "leak.txt", shared / "ray.log"
    for path in (mine, theirs):
        path.write_text("x")
    (shared / "nested").mkdir()
    (shared / "nested/deeper.txt").write_text("x")
    (shared / "link").symlink_to(theirs)
    uid = 54321
    for path in (mine, shared / "nested", shared / "nested/deeper.txt"):
        os.chown(path, uid, -1)
    os.chown(shared / "link", uid, -1, follow_symlinks=False)
    closed = tmp_path / "tmp/closed"
    closed.mkdir(mode=0o700)  # the uid could not reach in here: not read at all
    (closed / "other.txt").write_text("x")
    os.chown(closed / "other.txt", uid, -1)
    remove_scratch(uid, (str(tmp_path / "tmp"),))
    assert sorted(p.name for p in shared.iterdir()) == ["ray.log"]  # the link went, not its target
    assert (closed / "other.txt").exists()


def test_an_evaluation_rounds_launch_leaves_the_other_rounds_folders_as_they_were(tmp_path: Path) -> None:
    """An eval execution's workspace is workspaces/eval-<step>/<id>: the run folder is two levels up.
    Taken as one level up, a round's launch closed (0700) a running round's folder, whose agents then
    failed on their own workspace, and made a stray workspaces/records."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    first = run / "workspaces" / "eval-1" / "eval-greeting-0"
    second = run / "workspaces" / "eval-2" / "eval-greeting-0"
    train = run / "workspaces" / "s0-greeting-0"
    for workspace in (first, train, second):
        assert job_workspaces(workspace) == run / "workspaces"
        protect_job_folders(job_workspaces(workspace))
        workspace.mkdir(parents=True)
    for round_folder in ("eval-1", "eval-2"):
        assert stat.S_IMODE((run / "workspaces" / round_folder).stat().st_mode) == 0o711
    assert not (run / "workspaces" / "records").exists()
    assert stat.S_IMODE((run / "records").stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "metrics.jsonl").stat().st_mode) & 0o077 == 0  # the job's files: closed
    assert stat.S_IMODE(run.stat().st_mode) == 0o711


@pytest.mark.skipif(
    not own_uids("auto") and os.environ.get("CI") != "true", reason="needs root and useradd for pool users"
)
def test_harnesses_a_dead_executor_left_running_are_ended_when_an_executor_starts() -> None:
    """A slot's flock dies with the executor's process, its harness does not; `reap_orphans` (run as
    an executor starts) ends it, and leaves alone the processes of a slot still held."""
    dead, alive = acquire_identity("user"), acquire_identity("user")
    orphan = _sleep_as(dead)
    held = _sleep_as(alive)
    try:
        dead.release()  # its executor died: the flock went with it, the harness runs on
        reaped = reap_orphans()  # (an executor starting in a parallel test may reap it first)
        assert orphan.wait(timeout=15) == -signal.SIGKILL
        assert alive.name not in reaped and held.poll() is None  # its execution is alive
    finally:
        for identity, proc in ((dead, orphan), (alive, held)):
            kill_all(identity, None)
            proc.wait(timeout=15)
        reclaim(dead)
        reclaim(alive)


def _sleep_as(identity) -> subprocess.Popen:
    return subprocess.Popen(
        ["sleep", "300"], user=identity.uid, group=identity.gid, extra_groups=[], start_new_session=True
    )


def test_a_workspace_root_others_may_write_is_closed_and_a_link_refused(tmp_path: Path) -> None:
    # a Kubernetes emptyDir is 0777 without the sticky bit: a sandbox uid could swap the run's folder
    root = tmp_path / "workspaces"
    root.mkdir()
    os.chmod(root, 0o777)
    secure_workspace_root(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o711
    os.chmod(root, 0o755)
    secure_workspace_root(root)  # not writable by others: left as it is
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    fresh = tmp_path / "new" / "root"
    secure_workspace_root(fresh)
    assert fresh.is_dir()
    link = tmp_path / "link"
    link.symlink_to(root)
    with pytest.raises(SandboxError, match="not a symbolic link"):
        secure_workspace_root(link)


def test_with_a_workspace_root_the_run_folder_is_closed(tmp_path: Path) -> None:
    from gyre_ray.config import load_config
    from gyre_ray.train import close_run_folder

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    close_run_folder(load_config(None, []), run_dir)  # workspaces in the run folder: opened per launch
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o755
    close_run_folder(
        load_config(None, [f"agents.workspace_root={tmp_path / 'ws'}", "agents.isolation=none"]), run_dir
    )
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o755  # no sandbox: nothing to close it to
    close_run_folder(load_config(None, [f"agents.workspace_root={tmp_path / 'ws'}"]), run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


@pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true", reason="needs root to own files as another uid"
)
def test_hidden_tests_someone_else_owns_and_leaves_open_are_refused() -> None:
    """The job closes only its own folders: another owner's open hidden tests (a bind mount owned by
    uid 1000, say) were left readable by every execution, silently. A closed parent folder hides them."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gyre-hidden-", dir="/tmp"))  # (pytest's own tmp is 0700)
    try:
        hidden = root / "tasks/hidden/a"
        hidden.mkdir(parents=True)
        for folder in (root, root / "tasks", root / "tasks/hidden", hidden):
            folder.chmod(0o755)
        os.chown(hidden, 1000, 1000)
        with pytest.raises(
            SandboxError, match=r"hidden tests .* readable by the executions' uids \(owned by uid 1000"
        ):
            close_hidden_tests([hidden])
        (root / "tasks").chmod(0o750)  # closed above: nothing of it is reachable
        assert close_hidden_tests([hidden]) == []
        (root / "tasks").chmod(0o755)
        hidden.chmod(0o700)  # closed by its owner
        assert close_hidden_tests([hidden]) == []
    finally:
        shutil.rmtree(root)
