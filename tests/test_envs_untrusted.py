"""The job reads and writes files in folders an execution controls without following its links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gyre_ray.envs.toy import read_answer
from gyre_ray.envs.untrusted import UntrustedFileError, read_untrusted, remove_entries, write_fresh


def test_read_untrusted_reads_regular_files_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert read_untrusted(path, 4) == b"0123"
    assert read_untrusted(path, 4, tail=True) == b"6789"
    assert read_untrusted(path, 100) == b"0123456789"
    with pytest.raises(FileNotFoundError):
        read_untrusted(tmp_path / "missing", 4)


def test_read_untrusted_refuses_links_folders_and_fifos(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("aeiou")
    (tmp_path / "link").symlink_to(secret)
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")  # would block a plain open() forever
    with pytest.raises(UntrustedFileError, match="link is a symbolic link"):
        read_untrusted(tmp_path / "link", 100)
    for name in ("folder", "fifo"):
        with pytest.raises(UntrustedFileError, match=f"{name} is not a regular file"):
            read_untrusted(tmp_path / name, 100)


def test_write_fresh_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = tmp_path / "pytest.ini"
    planted.symlink_to(victim)
    write_fresh(planted, "[pytest]\n")
    assert victim.read_text() == "keep"
    assert not planted.is_symlink() and planted.read_text() == "[pytest]\n"


def test_a_linked_answer_scores_zero_without_reading_the_target(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("aeiou")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "answer.txt").symlink_to(secret)
    result = read_answer(workspace)
    assert not isinstance(result, str)
    assert result.valid and result.reward == 0.0 and "symbolic link" in result.detail
    (workspace / "answer.txt").unlink()
    (workspace / "answer.txt").write_text("x" * (2 << 20))
    assert read_answer(workspace) == "x" * (1 << 20)  # at most MAX_ANSWER_BYTES are read


def test_removing_an_agents_leftovers_never_follows_a_link(tmp_path: Path) -> None:
    kept = tmp_path / "job"
    kept.mkdir()
    (kept / "secret").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    (work / "tree/deep").mkdir(parents=True)
    (work / "tree/deep/file").write_text("x")
    (work / "tree/link").symlink_to(kept)
    (work / "link").symlink_to(kept)
    os.mkfifo(work / "fifo")
    (work / "file").write_text("x")
    names = ("tree", "link", "fifo", "file", "missing")
    remove_entries(*(work / name for name in names))
    assert list(work.iterdir()) == []
    assert (kept / "secret").read_text() == "x"  # what the links pointed at is untouched
