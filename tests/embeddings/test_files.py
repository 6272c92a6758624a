"""``tigana.embeddings.files``: the lock file excludes a second holder (another open of it, as another process
would), names the holder, and is free again once closed; fsync takes files and directories."""

from __future__ import annotations

import os

from tigana.embeddings.files import fsync_path, hold_lock


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


def test_fsync_takes_files_and_directories(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    fsync_path(tmp_path / "f")
    fsync_path(tmp_path)
