"""Scripted scenarios of the simulator: each defect of issue 16's list (the ones a simulated cluster can
express) as a timed list of operations over the seeded workload, with the invariant that caught it.

| scenario | defect (issue 16, "What happens today") | checked by |
| --- | --- | --- |
| ``test_a_table_dropped_with_items_in_flight_wedges_nothing`` | a dropped table's items answered REJECT_BEHIND for ever | liveness, no demotion |
| ``test_hand_overs_and_removed_copies_demote_nothing`` | a map change with items in flight demoted every copy | demotions without a fault |
| ``test_a_late_caught_up_report_marks_no_demoted_copy_in_sync`` | a stale CopyCaughtUp marked a half-built copy in sync | S1, the report refused |
| ``test_the_readme_start_up_ends_replicated_and_balanced`` | servers joining one by one: never replicated | liveness, balance |
| ``test_a_restarted_primary_never_leads_with_its_empty_copy`` | a restarted primary's empty copy kept leading | S1 |
| ``test_the_readme_start_up_replicates_before_any_table_exists`` | copies of empty slots never reported | liveness |
| ``test_every_copy_of_a_slot_lost_costs_only_what_followed_its_last_snapshot`` | the unclean election | S1 relaxed |
| ``test_clock_jumps_declare_no_server_dead_and_demote_nothing`` | (L6: a jumping clock is no failure) | no demotion |
| ``test_a_deposed_primary_refused_by_its_old_replica_acknowledges_nothing_only_it_applied`` | (issue 17, random seeds: an item cut by a refusal, or skipped by a copy the map dropped, acknowledged writes only a deposed primary applied) | S1 |
| ``test_a_whole_host_lost_at_once_loses_nothing_sync`` | (issue 44: placement knew servers, not hosts; both copies of a slot on one host) | S1, domains at convergence |

Each was run against the old behaviour patched back in (not kept here): the dropped table's items refused as
REJECT_BEHIND, a refusal reporting every copy of the stream with removed copies' items refused, the scheduler
ignoring a report's epoch, auto-rebalance off, a slot copy of no rows never moving on, a restarted server's
copies kept as they were; each scenario failed on it.
"""

from __future__ import annotations

import pytest

from tigana.tools.testing.sim import Op, Outcome, Settings, run_seed

QUIET = dict(faults=False)


def _ok(out: Outcome) -> None:
    assert out.ok, (out.violations, "\n".join(out.minimal_trace(120)))
    assert out.acked > 0 and out.convergence_s is not None


@pytest.mark.parametrize("seed", [1])
def test_a_table_dropped_with_items_in_flight_wedges_nothing(seed: int) -> None:
    script = tuple(op for k in range(3) for op in (
        Op(1.0 + 2.0 * k, "create", f"scratch{k % 2}"), Op(2.2 + 2.0 * k, "drop", f"scratch{k % 2}")))
    out = run_seed(seed, Settings(busy_s=8.0, script=script, **QUIET))
    _ok(out)
    assert out.demotions == 0


@pytest.mark.parametrize("seed", [4])
def test_hand_overs_and_removed_copies_demote_nothing(seed: int) -> None:
    script = [Op(1.5, "create_async", "scratch0")]
    for k in range(8):
        at = 2.0 + 0.5 * k
        script.append(Op(at, "move_primary", f"replica:{k}", slot=k))  # the cheapest hand-over
        script.append(Op(at + 0.1, "move", f"s{(k + 2) % 3}", slot=8 + k))  # a copy added, one removed
    script += [Op(6.5, "drop", "scratch0"), Op(7.0, "rebalance"), Op(7.5, "join"), Op(8.0, "rebalance")]
    out = run_seed(seed, Settings(busy_s=10.0, script=tuple(script), **QUIET))
    _ok(out)
    assert out.demotions == 0 and out.demotions_without_fault == 0 and out.failed_pushes == 0


@pytest.mark.parametrize("seed", [5])
def test_a_late_caught_up_report_marks_no_demoted_copy_in_sync(seed: int) -> None:
    # Every caught-up report of the start-up arrives a second time 6 s later; meanwhile the replica of slot 0
    # is cut off from the other servers (not the scheduler) long enough to be demoted and miss acked pushes.
    # The scheduler refuses the late reports as stale. (Were it to take one, the primary, whose new slot copy
    # covers the copies the map would then have in sync, refuses and reports them at once: S1 holds either way,
    # so the refusal itself is what this scenario asserts.)
    script = (Op(0.0, "late_reports", seconds=6.0), Op(2.5, "partition", "replica:0", seconds=6.0))
    out = run_seed(seed, Settings(busy_s=12.0, script=script, **QUIET))
    _ok(out)
    late = [line for line in out.trace if "late caught-up report" in line]
    assert late and all("'stale: " in line or "already in sync" in line for line in late), late
    assert any("stale caught-up report" in line and line.endswith("refused") for line in out.trace)


@pytest.mark.parametrize("seed", [6])
def test_the_readme_start_up_ends_replicated_and_balanced(seed: int) -> None:
    # The README's order: the scheduler, then servers one by one, then a trainer that creates its tables.
    script = (Op(1.0, "join"), Op(2.0, "join"))
    out = run_seed(seed, Settings(servers=1, busy_s=6.0, script=script, tables_at_s=3.0, **QUIET))
    _ok(out)
    assert out.demotions == 0
    assert out.convergence_s < 10.0
    assert all(n > 0 for n in out.copies_per_server.values()), out.copies_per_server


def test_the_readme_start_up_replicates_before_any_table_exists() -> None:
    # No trainer yet: slot copies with no rows and no tables must still finish (nothing acknowledges them).
    out = run_seed(12, Settings(servers=1, busy_s=4.0, script=(Op(1.0, "join"), Op(2.0, "join")),
                                tables_at_s=1e9, **QUIET))
    assert out.ok, (out.violations, "\n".join(out.minimal_trace(60)))
    assert out.convergence_s is not None and out.convergence_s < 10.0


@pytest.mark.parametrize("seed", [8])
def test_a_restarted_primary_never_leads_with_its_empty_copy(seed: int) -> None:
    # The primary of slot 0 is killed and back (a new process, empty) before the scheduler's timeout.
    script = (Op(3.0, "crash_restart", "primary:0", seconds=0.6), Op(6.0, "crash_restart", "primary:5", seconds=1.0))
    out = run_seed(seed, Settings(busy_s=9.0, script=script, **QUIET))
    _ok(out)


@pytest.mark.parametrize("seed", [13])
def test_every_copy_of_a_slot_lost_costs_only_what_followed_its_last_snapshot(seed: int) -> None:
    # Data dirs with a snapshot every 1.5 s; every copy of slot 3 is lost at once, back from disk 1.5 s later
    # (the unclean election: the newest snapshot wins, and it is not a restarted server's empty copy).
    script = (Op(4.2, "lose_slot", slot=3, seconds=1.5), Op(8.0, "lose_slot", slot=9, seconds=0.5))
    out = run_seed(seed, Settings(busy_s=11.0, script=script, snapshot_every_s=1.5, **QUIET))
    _ok(out)
    assert any("unclean election" in line for line in out.trace)


@pytest.mark.parametrize("seed", [23, 28, 244])
def test_a_deposed_primary_refused_by_its_old_replica_acknowledges_nothing_only_it_applied(seed: int) -> None:
    # The random schedules (faults on, bench sim's settings) that found it. Seed 244: a primary paused, declared
    # dead, its slots failed over and moved on, its old replica's copies dropped; resumed, it sent its queued
    # writes to that replica, which skipped them as moot (slots no longer held) and acknowledged them: now
    # refused as stale, since the sender does not lead them. Seed 28: a primary cut off from the
    # scheduler and the servers, not from its clients, applies their sync pushes and waits for its replica; it
    # is declared dead and its slots fail over; back before its clients learn the new map, its old replica
    # refuses the queued writes (REJECT_STALE), which cuts them out of the queued items, and the
    # acknowledgement of what was left of them released the waiting pushes: S1 lost on the new primary.
    out = run_seed(seed, Settings(busy_s=15.0))
    _ok(out)


def test_a_copy_into_a_server_that_restarted_meanwhile_never_counts() -> None:
    # The random schedule (bench sim's settings) that found it, seed 147: s2 restarts (boot 2), copies into it
    # start and send every row; 30 ms later it restarts again (boot 3). s0's report of its copy into boot 2
    # arrived after the new registration and was taken: a copy with none of 18 acknowledged writes entered the
    # in-sync set (S3). Refused as stale, the copies of s3 and s4, which had sent every row to boot 2 and waited
    # for nothing more, never started again (L3): a new boot now gets a new stream, and every copy starts again.
    out = run_seed(147, Settings(busy_s=15.0))
    _ok(out)
    assert any("refused as stale by the scheduler" in line for line in out.trace)


def test_a_scheduler_whose_clock_jumps_before_its_first_tick_declares_nobody_dead() -> None:
    # Seed 399 (bench sim's settings): the scheduler restarts from its store and its clock jumps 5.3 s before
    # its first tick; with no tick before it to measure the stall by, every server was declared dead at once
    # ("no heartbeat for 5.5s"), which the L6 checker caught.
    out = run_seed(399, Settings(busy_s=15.0))
    _ok(out)
    assert any("jumps" in line and "scheduler" in line for line in out.ops)
    assert any("scheduler stalled" in line for line in out.trace)


def test_clock_jumps_declare_no_server_dead_and_demote_nothing() -> None:
    # The scheduler's clock jumps past the heartbeat timeout; a primary's and a replica's clocks jump too.
    script = (Op(3.0, "clock_jump", "scheduler", seconds=5.0), Op(5.0, "clock_jump", "primary:0", seconds=4.0),
              Op(6.0, "clock_jump", "replica:3", seconds=10.0))
    out = run_seed(15, Settings(busy_s=9.0, script=script, **QUIET))
    _ok(out)
    assert out.demotions == 0 and out.failed_pushes == 0
    assert not [line for line in out.trace if "declared dead" in line or "is dead" in line]


@pytest.mark.parametrize("seed", [7, 8])
def test_a_whole_host_lost_at_once_loses_nothing_sync(seed: int) -> None:
    # Four servers on two hosts (s0, s2 on h0; s1, s3 on h1): every slot keeps a copy on each host, so when
    # both servers of h0 crash at once (no data dirs: they come back empty), the copies on h1 hold every
    # acknowledged sync push.
    script = (Op(3.0, "domain_crash", "h0", seconds=3.0),)
    out = run_seed(seed, Settings(servers=4, hosts=2, busy_s=9.0, script=script, **QUIET))
    _ok(out)
    assert any("domain_crash host h0: crash s0,s2" in op for op in out.ops), out.ops
