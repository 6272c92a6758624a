"""``tigana bench failover`` and ``tigana bench ps --replicas`` end to end on a tiny workload (real processes)."""

from __future__ import annotations

import pytest

from tigana import ps
from tigana.tools import cli
from tigana.tools.bench import reshard

pytestmark = pytest.mark.timeout(300)


def test_bench_failover_one_trial(bench_lines):
    assert cli.main(["bench", "failover", "--trials", "1", "--ids", "5000", "--ids-per-push", "200"]) == 0
    (line,) = bench_lines()
    assert line["case"] == "failover" and line["unit"] == "s" and line["trials"] == 1
    assert line["lost"] == 0 and line["doubled"] == 0 and line["copies_differing"] == 0
    assert line["value"] == pytest.approx(line["recovery_s_p95"], rel=1e-2) and line["value"] > 0
    assert line["peer_value"] == 3.0
    for key in ("recovery_s_p50", "acked_pushes", "ratio", "peer"):
        assert key in line


def test_bench_ps_replicas_reports_sync_and_async_against_none(bench_lines):
    argv = ["bench", "ps", "--replicas", "1", "--quick", "--batch", "2048", "--num-ids", "100000", "--dims", "8",
            "--repeats", "1"]
    assert cli.main(argv) == 0
    lines = bench_lines()
    assert {d["case"] for d in lines} == {"push_sync", "push_async", "pull_sync", "pull_async"}
    for d in lines:
        assert d["peer"] == "no replication" and d["value"] > 0 and d["peer_value"] > 0 and d["replicas"] == 1
        assert d["durability"] in ("sync", "async") and d["dim"] == 8


def test_bench_reshard_moves_drains_and_leaves_every_copy_equal(bench_lines, monkeypatch):
    """The scheduler places the slots as soon as its first server registers (--bootstrap-wait 0), as it does
    when the others start later than the wait on a loaded machine: the bench evens the three servers out before
    it loads the table, so the 4th server's move copies its share, not the rows a late server lacked too (one
    make test run reported every row copied, twice the share)."""
    real = ps.LocalCluster

    def early(*args, scheduler_args=(), **kwargs):
        return real(*args, scheduler_args=[*scheduler_args, "--bootstrap-wait", "0"], **kwargs)

    monkeypatch.setattr(reshard.ps, "LocalCluster", early)
    assert cli.main(["bench", "reshard", "--rows", "20000", "--batch", "1024"]) == 0
    lines = {d["case"]: d for d in bench_lines()}
    assert set(lines) == {"reshard.move", "reshard.push_p99", "reshard.balance", "reshard.drain"}
    for d in lines.values():
        assert d["value"] > 0 and d["peer_value"] > 0 and d["rows"] == 20000 and d["replicas"] == 1
        assert d["ratio"] == pytest.approx(d["value"] / d["peer_value"], rel=2e-3)
    # the 4th server's share was copied to it, once: a quarter of the 2 copies of the 20,000 rows and of those
    # the traffic inserted (about 11,190)
    move = lines["reshard.move"]
    assert 0 < move["rows_moved"] <= 20000 and move["rows_moved"] <= 1.05 * move["rows_share"], move
    assert lines["reshard.drain"]["copies_differing"] == 0 and lines["reshard.drain"]["rows_held"] > 0
    assert lines["reshard.balance"]["servers"] == 4
    p99 = lines["reshard.push_p99"]  # the samples behind each p99 are reported with it
    assert p99["pushes_during"] >= 1 and p99["pushes_before"] >= 1
