"""``tigana bench nemesis --quick`` end to end: a cluster started through the CLI as the README says, ledger
clients at once, every planned operation on sync and async tables, then kill -9, SIGSTOP and a restart.

This is the test of issue 16's promise (no acknowledged update lost, no copy demoted by a planned operation):
it asserts the targets themselves, not only that the line is well formed."""

from __future__ import annotations

import random
import threading

import pytest

from tigana.tools import cli
from tigana.tools.testing.nemesis import KEYS, targets_missed
from tigana.tools.testing.nemesis.schedule import FAULTS, PLANNED, plan_round
from tigana.tools.testing.nemesis.workload import LedgerClient, Ledgers

pytestmark = pytest.mark.timeout(600)


def test_a_round_holds_every_planned_operation_and_creates_the_scratch_table_before_dropping_it():
    for seed in range(50):
        rng = random.Random(seed)
        clean = plan_round(rng, faults=False, join=True)
        assert sorted(clean) == sorted(PLANNED)
        assert clean.index("scratch_create") < clean.index("scratch_drop")
        mixed = plan_round(rng, faults=True, join=False)
        assert sorted(mixed) == sorted([op for op in PLANNED if op != "join"] + list(FAULTS))
    assert plan_round(random.Random(3), faults=True, join=True) == plan_round(random.Random(3), faults=True,
                                                                              join=True)


def test_targets_name_every_miss():
    history = {"phantom_reads": 0, "linearizability_violations": 3, "max_read_deficit": 10}
    good = {"lost_sync": 0, "doubled_sync": 0, "lost_async": 5, "doubled_async": 0, "async_loss_bound": 10,
            "primaries_killed": 1, "copies_demoted_without_failure": 0, "max_push_stall_s": 2.0, "verify": "ok",
            "ops_failed": 0, "torn_rows": 0, "linearizability_violations": 0, "history_async": history}
    assert targets_missed(good, 3.0) == []
    assert targets_missed({**good, "primaries_killed": 0}, 3.0)  # async loss with no primary killed
    assert targets_missed({**good, "lost_async": 11}, 3.0)  # past the reported bound
    assert targets_missed({**good, "copies_demoted_without_failure": 1}, 3.0)
    assert targets_missed({**good, "max_push_stall_s": 9.0}, 3.0)
    assert targets_missed({**good, "doubled_sync": 1}, 3.0)
    assert targets_missed({**good, "lost_async_before_faults": 1}, 3.0)  # lost to planned operations alone
    assert targets_missed({**good, "faults_unprotected": 1}, 3.0)  # a second failure before the first healed
    assert targets_missed({**good, "linearizability_violations": 1}, 3.0) == ["sync: 0 linearizability violations"]
    assert targets_missed({**good, "history_async": {**history, "max_read_deficit": 11}}, 3.0)  # past the bound
    assert targets_missed({**good, "history_async": {**history, "phantom_reads": 1}}, 3.0)
    assert targets_missed({**good, "primaries_killed": 0, "lost_async": 0}, 3.0)  # async stale with no kill
    assert targets_missed({**good, "lost_async": None, "lost_sync": None}, 3.0) == [  # the tables unreadable
        "sync: 0 lost, 0 doubled", "async: 0 doubled, 0 lost unless a primary was killed, then within the bound"]


def test_the_stall_counts_from_the_first_acknowledgement_and_start_up_apart():
    class Loop:  # the two fields of a PushLoop that the stall reads
        def __init__(self, events):
            self._lock, self.events = threading.Lock(), events

    ledgers = Ledgers("unused:0")
    ledgers.clients = [LedgerClient("sync", None, Loop([(10.0, 14.0), (14.0, 15.0), (21.0, 22.0)]), 0.0, 25.0),
                       LedgerClient("async", None, Loop([(2.0, 3.0), (3.0, 4.0)]), 0.0, 5.0)]
    assert ledgers.first_ack_s() == 14.0  # the sync client's wait for its first acknowledgement
    assert ledgers.max_stall() == (7.0, 15.0, "sync")  # 15 s -> 22 s without one
    ledgers.clients.append(LedgerClient("async", None, Loop([]), 1.0, 4.0))
    assert ledgers.first_ack_s() is None  # a client that never got one


def test_a_stall_is_told_by_the_operations_it_overlaps():
    from tigana.tools.testing.nemesis.bench import _during
    from tigana.tools.testing.nemesis.operations import OpResult

    results = [OpResult("move", True, 2.0, started_at=10.0), OpResult("pause", True, 4.0, started_at=15.0)]
    assert _during(results, 14.0, 5.0, "sync", 0.0) == "sync client, 14.0s after start: pause (overlapping it)"
    assert _during(results, 11.0, 5.0, "sync", 0.0) == "sync client, 11.0s after start: move, pause (overlapping it)"
    assert _during(results, 12.5, 1.0, "sync", 0.0) == "sync client, 12.5s after start: move (the last one before)"
    assert _during(results, 1.0, 1.0, "async", 0.0) == "async client, 1.0s after start: start-up, before any operation"


def test_bench_nemesis_quick_meets_its_targets(bench_lines):
    rc = cli.main(["bench", "nemesis", "--quick"])
    (line,) = bench_lines()
    assert line["case"] == "nemesis" and line["unit"] == "s" and line["peer_value"] == 3 * line["heartbeat_timeout_s"]
    assert "error" not in line, line.get("error")
    for key in (*KEYS, "ok", "targets_missed", "ops_run", "failed"):
        assert key in line, key
    assert line["targets_missed"] == [], line
    assert line["lost_sync"] == 0 and line["doubled_sync"] == 0
    assert line["lost_sync_before_faults"] == 0 and line["lost_async_before_faults"] == 0
    assert line["doubled_async"] == 0
    assert line["linearizability_violations"] == 0, line["history_sync"]["examples"]
    for dur in ("sync", "async"):  # the readers ran through the whole run and every read was checked
        h = line[f"history_{dur}"]
        assert h["reads"] > 10 and h["checked"] == 1000 * h["reads"] and h["phantom_reads"] == 0, h
    if not line["primaries_killed"]:
        assert line["linearizability_violations_async"] == 0, line["history_async"]["examples"]
    assert line["lost_async"] <= (line["async_loss_bound"] if line["primaries_killed"] else 0)
    assert line["copies_demoted_without_failure"] == 0, line["demotion_reasons"]
    assert line["max_push_stall_s"] < 3 * line["heartbeat_timeout_s"]
    assert line["verify"] == "ok"
    assert rc == 0 and line["ok"] is True
    assert line["dir"] is None  # the temporary folder of a run that met its targets is removed
    assert line["faults_unprotected"] == 0 and line["max_reprotect_s"] < 60
    # the quick form ran every planned operation under both ledger tables' traffic, and the faults
    assert set(line["ops_run"]) >= set(PLANNED) and line["faults_injected"] == len(FAULTS)
    assert line["acked_pushes_sync"] > 0 and line["acked_pushes_async"] > 0
