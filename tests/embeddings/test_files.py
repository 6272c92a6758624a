"""``tigana.embeddings.files``: the lock file excludes a second holder (another open of it, as another process
would), names the holder, and is free again once closed; fsync takes files and directories; an atomic write
replaces a file whole or leaves it as it was, with no temp file left behind; a folder is published whole."""

from __future__ import annotations

import hashlib
import os

import pytest

from tigana.embeddings.files import (
    FileMismatch,
    atomic_replace,
    atomic_write,
    fsync_path,
    hold_lock,
    publish_folder,
    read_checked,
    temp_beside,
)


def test_the_lock_has_one_holder_and_is_free_after_close(tmp_path) -> None:
    path = tmp_path / "LOCK"
    first, owner = hold_lock(path)
    assert first is not None and owner == ""
    second, owner = hold_lock(path)
    assert second is None and owner == f"pid {os.getpid()}"
    first.close()
    third, owner = hold_lock(path)
    assert third is not None and owner == ""
    third.close()


def test_fsync_takes_files_and_directories(tmp_path, monkeypatch) -> None:
    """Each call fsyncs a descriptor of the very file or directory named (same inode), closes it, and leaves
    the content as it was; a missing path raises rather than syncing nothing."""
    (tmp_path / "f").write_text("x")
    synced: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    open_fds = set(os.listdir("/proc/self/fd"))
    for path in (tmp_path / "f", tmp_path):
        fsync_path(path)
        st = os.stat(path)
        assert synced[-1] == (st.st_dev, st.st_ino), path
    assert len(synced) == 2
    assert set(os.listdir("/proc/self/fd")) == open_fds  # every descriptor it opened was closed
    assert (tmp_path / "f").read_text() == "x"
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "missing")
    assert len(synced) == 2


def test_an_atomic_write_replaces_the_file_and_leaves_no_temp(tmp_path) -> None:
    path = tmp_path / "state.json"
    atomic_write(path, "old")
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_atomic_replace_keeps_the_old_file_and_removes_the_temp(tmp_path) -> None:
    path = tmp_path / "state.json"
    atomic_write(path, "old")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_replace(path) as tmp:
        assert tmp == temp_beside(path) and tmp.parent == path.parent and tmp.name.startswith(".")
        tmp.write_text("half")
        raise RuntimeError("mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_atomic_write_into_a_missing_folder_raises_oserror(tmp_path) -> None:
    with pytest.raises(OSError):
        atomic_write(tmp_path / "missing" / "f", "x")


def test_a_folder_is_published_whole_under_its_final_name(tmp_path) -> None:
    tmp = tmp_path / ".tmp-part"
    (tmp / "rows").mkdir(parents=True)
    (tmp / "rows" / "data").write_bytes(b"rows")
    (tmp / "manifest.json").write_text("{}")
    publish_folder(tmp, tmp_path / "part")
    assert not tmp.exists()
    assert (tmp_path / "part" / "rows" / "data").read_bytes() == b"rows"
    assert (tmp_path / "part" / "manifest.json").read_text() == "{}"
    (tmp_path / ".tmp-other").mkdir()
    (tmp_path / ".tmp-other" / "f").write_text("x")
    with pytest.raises(OSError):  # a published folder is never replaced
        publish_folder(tmp_path / ".tmp-other", tmp_path / "part")
    assert (tmp_path / "part" / "manifest.json").exists()


def test_a_checked_read_returns_the_bytes_and_refuses_another_size_or_sha256(tmp_path) -> None:
    f = tmp_path / "part.npz"
    f.write_bytes(b"rows" * 100)
    digest = hashlib.sha256(b"rows" * 100).hexdigest()
    assert read_checked(f, digest, 400) == b"rows" * 100
    assert read_checked(f, digest) == b"rows" * 100  # no size recorded: the sha256 alone
    with pytest.raises(FileMismatch, match="part.npz"):
        read_checked(f, digest, 401)
    f.write_bytes(b"rowz" * 100)  # same size, other bytes
    with pytest.raises(FileMismatch):
        read_checked(f, digest, 400)
    with pytest.raises(OSError):
        read_checked(tmp_path / "missing", digest)
