"""``ps.LocalEtcd`` (a one-member etcd on loopback for an HA scheduler on one machine) starts even when a port it
picked was taken before etcd could bind it, and says why when etcd cannot start."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest

from tigana import ps
from tigana.ps.ops import local
from tigana.ps.scheduler.stores.etcd import wait_for_etcd

pytestmark = pytest.mark.skipif(shutil.which("etcd", path=str(Path(sys.executable).parent)) is None
                                and shutil.which("etcd") is None, reason="etcd binary not installed")


def test_a_port_taken_before_etcd_binds_it_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the race two test workers met: a port free when picked, bound by another process before etcd bound it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        real = local.free_port
        monkeypatch.setattr(local, "free_port", lambda: next(picks, None) or real())
        with ps.LocalEtcd(tmp_path / "etcd") as etcd:
            assert not etcd.url.endswith(f":{busy}")
            wait_for_etcd(etcd.url, 5.0)  # it answers
        assert "address already in use" in (tmp_path / "etcd" / "etcd.log").read_text()


def test_an_etcd_that_cannot_start_says_why_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(local, "free_port", lambda: busy)  # every start meets the taken port
        with pytest.raises(RuntimeError, match="address already in use"):
            ps.LocalEtcd(tmp_path / "etcd", startup_timeout=20)
