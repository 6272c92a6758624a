"""The quick form of ``tigana bench faults``, for the faults that need no root: each runs on real daemons
(``ps.LocalCluster``) and must meet its target. The faults that need root (a partition with network
namespaces, a full tmpfs) run when ``TIGANA_ROOT_FAULTS=1`` and the process is root; ``tigana bench faults``
runs them all with more trials. Kills, pauses, the scheduler and mid-move kills have their own tests in this
folder (test_failover, test_durability, test_resharding)."""

from __future__ import annotations

import json
import os

import pytest

from tigana.tools import cli
from tigana.tools.testing.faults import FAULTS, function
from tigana.tools.testing.faults.common import root_problem

pytestmark = pytest.mark.timeout(300)


def _run(name: str, trials: int, **kwargs):
    report = function(name)(trials=trials, quick=True, **kwargs)
    print(name, report.figures)
    assert report.ok, (name, report.figures)
    return report.figures


def test_kill_9_during_a_snapshot_write_restores_the_previous_snapshot() -> None:
    f = _run("snapshot_kill", 2)
    assert f["partial_restored"] == 0 and f["crashes"] == 0 and f["kills_mid_write"] >= 1


def test_a_full_lmdb_map_refuses_new_rows_cleanly_and_resumes() -> None:
    f = _run("lmdb_map_full", 1)
    assert f["rejected_pct"] == 100.0 and f["state_changes"] == 0 and f["resumed_pct"] == 100.0


def test_a_corrupted_store_is_detected_and_resynced_from_the_replica() -> None:
    f = _run("corrupt_store", 2)
    assert f["detected_pct"] == 100.0 and f["lost"] == 0 and f["doubled"] == 0


def test_malformed_requests_to_every_method_are_rejected_cleanly() -> None:
    f = _run("malformed", 1)
    assert f["rejected_pct"] == 100.0 and f["crashes"] == 0 and f["state_changes"] == 0


def test_bad_credentials_are_refused_and_change_nothing() -> None:
    pytest.importorskip("trustme")
    f = _run("credentials", 1)
    assert f["rejected_pct"] == 100.0 and f["tokens_in_logs"] == 0


def test_a_slow_link_under_the_timeouts_causes_no_failover() -> None:
    f = _run("slow_link", 1)  # a one-way delay of 0.8 s (the largest): round trips of 1.6 s, under every timeout
    assert f["false_failovers"] == 0 and f["copies_demoted"] == 0


def test_a_short_soak_with_servers_killed_and_replaced() -> None:
    f = _run("soak", 1, soak_s=10.0, kill_every_s=4.0)
    assert f["kills"] >= 1 and f["lost"] == 0 and f["doubled"] == 0


root = pytest.mark.skipif(os.environ.get("TIGANA_ROOT_FAULTS") != "1" or root_problem() is not None,
                          reason="needs root and TIGANA_ROOT_FAULTS=1 (network namespaces, tmpfs mounts)")


@root
def test_a_partitioned_primary_acknowledges_nothing_after_the_failover() -> None:
    f = _run("partition", 1)
    assert f["split_brain_writes"] == 0 and f["stale_epoch_probes"] > 0


@root
def test_a_full_disk_answers_resource_exhausted_and_resumes() -> None:
    f = _run("disk_full", 1)
    assert f["rejected_pct"] == 100.0 and f["corrupted"] == 0 and f["resumed_pct"] == 100.0


def test_invalid_requests_are_rejected_naming_what_is_wrong_and_the_bench_prints_one_line_per_fault(capsys) -> None:
    """The invalid-requests fault through ``tigana bench faults`` (the same run as ``_run("invalid", 1)``: it
    takes no quick form), and the bench's JSON lines."""
    only = "invalid" if root_problem() is None else "invalid,partition"  # as root, the partition would run
    assert cli.main(["bench", "faults", "--only", only, "--trials", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["case"] for x in lines] == [f"faults.{n}" for n in only.split(",")]
    assert lines[0]["rejected_pct"] == 100.0 and lines[0]["state_changes"] == 0 and lines[0]["ok"] is True
    assert {"case", "unit", "value", "peer", "peer_value", "ratio", "trials"} <= set(lines[0])
    if len(lines) > 1:
        assert lines[1]["skipped"].startswith("needs") and lines[1]["ok"] is True
    assert set(FAULTS) >= {"kill_sync", "kill_async", "snapshot_kill", "pause", "partition", "slow_link",
                           "disk_full", "lmdb_map_full", "corrupt_store", "malformed", "invalid", "credentials",
                           "mid_reshard", "scheduler", "soak"}
