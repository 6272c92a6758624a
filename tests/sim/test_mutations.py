"""A checker that never fires proves nothing: each test plants the bug an invariant forbids (in the real code,
monkeypatched for the test's duration only) and shows the simulator's checker for it firing within a few
seeds (docs/replication.md, "Checked by simulation": invariant -> checker -> mutation test)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from tigana.ps.client.sentparts import SentParts
from tigana.ps.replication import apply as apply_module
from tigana.ps.replication.intake import CopyIntake
from tigana.ps.replication.log import SlotLog
from tigana.ps.replication.primary import Primary
from tigana.ps.replication.replicator import Replicator
from tigana.ps.routing import CATCHING_UP, IN_SYNC, NO_SERVER, slot_of
from tigana.ps.scheduler import placement
from tigana.ps.scheduler.driver import SchedulerDriver
from tigana.ps.scheduler.liveness import Liveness
from tigana.ps.scheduler.moves import Moves
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.shard.ownership import Ownership
from tigana.ps.shard.view import Holdings
from tigana.ps.shard.writes import WritePath
from tigana.tools.testing.sim import Op, Settings, run_seed
from tigana.tools.testing.sim.nodes import SimServer
from tigana.tools.testing.sim.simulation import Outcome

FAULTS = dict(busy_s=5.0, faults=True, ops_per_s=1.5, converge_s=20.0)
QUIET = dict(faults=False, converge_s=20.0)


def fires(rule: str | tuple[str, ...], seeds: Iterable[int], **settings: object) -> Outcome:
    """The first run among ``seeds`` whose first violation is ``rule``'s; fails when none is."""
    rules = (rule,) if isinstance(rule, str) else rule
    seen = []
    for seed in seeds:
        out = run_seed(seed, Settings(**settings))
        if out.violations and out.violations[0].startswith(tuple(f"{r}:" for r in rules)):
            return out
        seen.append((seed, out.violations[:1]))
    raise AssertionError(f"{rules} never fired: {seen}")


def clean(seed: int, **settings: object) -> Outcome:
    """The scenario without the planted bug breaks nothing: what fires with it, fires for the bug."""
    out = run_seed(seed, Settings(**settings))
    assert out.ok and out.acked > 0, (out.violations, "\n".join(out.minimal_trace(60)))
    return out


def refusals(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[str]:
    """The ``Unavailable`` refusals ``cls.name`` raises from now on (counted, not changed)."""
    from tigana.ps.errors import Unavailable

    real, seen = getattr(cls, name), []

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            return real(*args, **kwargs)
        except Unavailable as exc:
            seen.append(str(exc))
            raise

    monkeypatch.setattr(cls, name, counted)
    return seen


def test_s1_a_primary_that_does_not_wait_for_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Primary, "mark_done", lambda self, m: True)
    fires("S1", range(3), **FAULTS)


def test_s2_a_catching_up_copy_promoted(monkeypatch: pytest.MonkeyPatch) -> None:
    real = placement.repair

    def repair(copies, states, alive, replicas, placeable=None, groups=None):  # noqa: ANN001, ANN202
        c, s = np.array(copies), np.array(states)
        alive = np.asarray(alive, bool)
        for slot in range(c.shape[0]):
            if c[slot, 0] >= 0 and not alive[c[slot, 0]]:
                for j in range(1, c.shape[1]):
                    if c[slot, j] >= 0 and alive[c[slot, j]] and s[slot, j] == CATCHING_UP:
                        c[slot, 0], s[slot, 0], c[slot, j], s[slot, j] = c[slot, j], IN_SYNC, NO_SERVER, 0
                        break
        return real(c, s, alive, replicas, placeable, groups)

    monkeypatch.setattr(placement, "repair", repair)
    # A copy of slot 0 is being added on s2 when its primary crashes: the failover finds it catching up.
    script = (Op(3.0, "move", "spare:0", slot=0), Op(3.0, "crash", "primary:0"))
    fires("S2", range(3), busy_s=8.0, script=script, **QUIET)


def test_s3_copies_added_in_sync_without_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    real = placement.repair

    def repair(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        c, s = real(*args, **kwargs)
        return c, np.where(s == CATCHING_UP, IN_SYNC, s).astype(s.dtype)

    monkeypatch.setattr(placement, "repair", repair)
    fires("S3", range(3), busy_s=6.0, script=(Op(3.0, "crash", "s1"),), **QUIET)


def test_s4_a_server_that_applies_pushes_for_slots_it_does_not_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Holdings, "check_leads", lambda self, table, ids, epoch, created_epoch=None:
                        (self.view, slot_of(ids, self.num_slots)))
    fires("S4", range(3), busy_s=6.0, ops_per_s=1.5, **QUIET)


def test_s5_an_item_applied_where_it_does_not_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SlotLog, "matches", lambda self, slots, prev: np.ones(len(slots), bool))
    # Three copies a slot: a primary that dies with writes on their way to one replica and not the other (cut
    # off for half a second) leaves them apart; the new primary's BARRIER no longer finds the one that missed
    # them.
    script = (Op(3.0, "partition", "replica:0", seconds=0.5), Op(3.3, "crash", "primary:0"))
    fires("S5", range(3), servers=4, replicas=2, busy_s=8.0, script=script, **QUIET)


def test_s6_a_duplicate_push_applied_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DedupWindow, "applied", lambda self, client_id, seq, slots: np.zeros(len(slots), bool))
    fires("S6", range(3), **FAULTS)


def test_s7_a_hand_over_reported_before_its_stream_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    def hand_over(self, timeout_s: float) -> bool:  # noqa: ANN001
        view = self.holdings.view
        if self.links.agent is None or not view.valid or not view.fenced.any():
            return False
        self.links.agent.handover_ready(np.flatnonzero(view.fenced).astype(np.int32), view.epoch)
        return True

    monkeypatch.setattr(Ownership, "hand_over", hand_over)
    # Each new primary is cut off from the other servers (not the scheduler) for a second, from 0.3 s before
    # its hand-over: the async writes its old primary acknowledged meanwhile are still queued for it.
    script = tuple(op for k in range(2) for op in (Op(2.0 + 2 * k, "partition", f"replica:{k}", seconds=1.0),
                                                  Op(2.3 + 2 * k, "move_primary", f"replica:{k}", slot=k)))
    fires("S7", range(2), busy_s=5.0, script=script, **QUIET)


def test_s8_a_push_applied_in_part(monkeypatch: pytest.MonkeyPatch) -> None:
    from tigana.embeddings import EmbeddingTable

    real = EmbeddingTable.push

    def push(self, ids, grads, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return real(self, ids[:-1], grads[:-1], **kwargs) if len(ids) > 1 else real(self, ids, grads, **kwargs)

    monkeypatch.setattr(EmbeddingTable, "push", push)
    fires("S8", range(2), busy_s=3.0, **QUIET)


def _tables_before_views(monkeypatch: pytest.MonkeyPatch, gap_s: float = 0.3) -> None:
    """Each server installs a map that creates a table in two steps ``gap_s`` apart, as the daemon's
    ``Ownership.install`` may be seen from a push: the new tables first, then (with every table's lock) the new
    view; maps that come meanwhile wait for the second step. A simulated install is otherwise one step, and no
    push could arrive in between."""
    real = SimServer.install

    def install(self: SimServer, m) -> None:  # noqa: ANN001
        svc = self.svc
        if self.up and svc is not None and m.epoch > svc.epoch:
            if any(svc.tables.find(name) is None for name in m.tables):
                with svc.tables.lock:
                    svc.ownership._sync_tables(m)  # the tables exist; the view is still the old map's
                self.held_until = self.world.now + gap_s
            until = getattr(self, "held_until", 0.0)
            if self.world.now < until:
                self.world.at(until - self.world.now, lambda: real(self, m))
                return
        real(self, m)

    monkeypatch.setattr(SimServer, "install", install)


def test_s9_a_table_that_takes_writes_before_its_map_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    _tables_before_views(monkeypatch)
    script = (Op(2.0, "create", "scratch0"),)  # the ledgers' creation, and a scratch table's, under pushes
    refused = refusals(monkeypatch, Holdings, "check_leads")
    clean(0, busy_s=4.0, script=script, **QUIET)
    assert any("before it installs that map" in r for r in refused)  # pushes came in the gap: refused, retried
    real = Holdings.check_leads
    monkeypatch.setattr(Holdings, "check_leads", lambda self, table, ids, epoch, created_epoch=None:
                        real(self, table, ids, epoch, None))  # the table's incarnation not checked
    fires("S9", range(3), busy_s=4.0, script=script, **QUIET)


def test_s10_an_election_that_names_the_oldest_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Data dirs, no periodic snapshot: slot 3's replica is snapshotted at 2.0 s and its primary at 3.5 s, with
    # pushes in between, so when every copy of it is lost at 4.0 s the two come back at different positions
    # (and so do the other slots the two servers held alone).
    script = (Op(2.0, "snapshot", "replica:3"), Op(3.5, "snapshot", "primary:3"),
              Op(4.0, "lose_slot", slot=3, seconds=1.0))
    settings = dict(busy_s=6.0, snapshot_every_s=1000.0, script=script, **QUIET)
    assert any("unclean election" in line for line in clean(0, **settings).trace)
    real = Liveness._elect

    def elect(self) -> None:  # noqa: ANN001
        saved = self.positions  # the election reads positions negated: the oldest rows win
        self.positions = {s: {t: {k: (-int(e), -int(i)) for k, (e, i) in slots.items()} for t, slots in tables.items()}
                          for s, tables in saved.items()}
        try:
            real(self)
        finally:
            self.positions = saved

    monkeypatch.setattr(Liveness, "_elect", elect)
    fires("S10", range(3), **settings)


def test_s11_copied_rows_that_overwrite_newer_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CopyIntake, "admit",
                        lambda self, ids, token, present: self.token[slot_of(ids, self.num_slots)] == token)
    # Caught by the copy's join (S3: it enters the in-sync set without an acknowledged write), by the same
    # position holding other rows (S5), or at convergence (S11), whichever comes first.
    fires(("S11", "S5", "S3"), range(4), busy_s=6.0, ops_per_s=1.5, **QUIET)


def test_s12_placement_that_ignores_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Moves, "_groups", lambda self, usable: None)  # no level keeps copies apart
    fires("S12", range(3), servers=4, hosts=2, busy_s=3.0, **QUIET)


def test_l1_caught_up_reports_never_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SchedulerDriver, "copy_caught_up",
                        lambda self, reporter, target, slots, since_epoch=0: (False, "planted: refused"))
    # No target (auto-rebalance off): the copies a crash makes never finish, and no move is pending.
    fires("L1", range(2), busy_s=3.0, auto_rebalance=False, script=(Op(1.0, "crash", "s1"),), **QUIET)


def test_l2_no_auto_rebalance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Moves, "_auto_rebalance", lambda self, copies, placeable: None)
    fires("L2", range(2), servers=2, busy_s=4.0, script=(Op(1.0, "join"),), **QUIET)


def test_l3_a_move_that_never_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "step_toward", lambda copies, states, target, **kwargs: (copies, states))
    fires("L3", range(2), busy_s=3.0, script=(Op(1.0, "rebalance"), Op(1.5, "drain", "s0")), **QUIET)


def test_l4_items_of_a_dropped_table_refused_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_served(name, table_epoch, request_epoch, view, why):  # noqa: ANN001, ANN202
        from tigana.proto import shard_pb2 as pb

        return pb.REJECT_BEHIND, f"table {name!r}: planted: {why}", None

    monkeypatch.setattr(apply_module, "_not_served", not_served)
    script = tuple(op for k in range(2) for op in (
        Op(1.0 + 1.5 * k, "create", f"scratch{k}"), Op(1.8 + 1.5 * k, "drop", f"scratch{k}")))
    # The stream refuses them until the copy is demoted for it (before, it waited for ever): a demotion with no
    # failure, or items still queued at the deadline.
    fires(("L4", "no-demotion"), range(2), busy_s=5.0, script=script, **QUIET)


def test_l5_writers_that_never_wait_for_room(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 1 KiB bound per stream (the real client keeps few sync pushes in flight: what they queue stays under
    # 4 KiB), and slot 0's replica cut off from the other servers for 1.5 s: its primary's stream fills, and the
    # writers are refused (the simulated ones never wait) until the partition heals.
    script = (Op(2.0, "partition", "replica:0", seconds=1.5),)
    settings = dict(busy_s=5.0, queue_bytes=1024, script=script, **QUIET)
    refused = refusals(monkeypatch, WritePath, "wait_for_room")
    clean(0, **settings)
    assert refused and all("more than max_queue_bytes" in r for r in refused)  # the bound met, and held
    monkeypatch.setattr(Replicator, "room", lambda self, slots, timeout_s: None)  # every writer finds room
    fires("L5", range(2), **settings)


def test_l7_parts_left_waiting_on_a_deposed_primary(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slot 0's primary paused for 6 s: the scheduler declares it dead after its heartbeat timeout, and the map
    # that fails slot 0 over names another primary. The parts the trainers sent to the paused server are routed
    # again when their client installs that map; with the re-route planted out they wait for their deadline.
    script = (Op(2.0, "pause", "primary:0", seconds=6.0),)
    settings = dict(busy_s=9.0, script=script, **QUIET)
    clean(0, **settings)
    monkeypatch.setattr(SentParts, "on_route", lambda self, route: 0)  # a new map re-routes nothing
    fires("L7", range(2), **settings)


def test_l6_a_tick_that_declares_silent_servers_dead_by_its_own_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scheduler's process stops for 5 s (longer than the heartbeat timeout) and goes on: the silence was
    # its own, and without the bug nobody is declared dead for it.
    settings = dict(busy_s=9.0, script=(Op(2.0, "pause", "scheduler", seconds=5.0),), **QUIET)
    out = clean(0, **settings)
    assert any("scheduler stalled" in line for line in out.trace)
    assert not [line for line in out.trace if "declared dead" in line]
    real = Liveness.tick
    monkeypatch.setattr(Liveness, "tick", lambda self, *, now, stalled=False, waited_s=0.0:
                        real(self, now=now))  # the stall detection removed: the silence is the servers'
    fires("L6", range(2), **settings)


def test_l6_a_closed_port_ignored_by_a_scheduler_stalled_at_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scheduler's clock jumps 1.5 s forward four times a second from 1 s to 9 s (every pass of its tick
    # loop sees a stall: the servers' silence is forgiven at each), and s1 crashes at 3 s: only the probe's
    # closed port can tell it s1 died.
    jumps = tuple(Op(1.0 + 0.25 * k, "clock_jump", "scheduler", seconds=1.5) for k in range(32))
    settings = dict(busy_s=10.0, script=(*jumps, Op(3.0, "crash", "s1")), **QUIET)
    dead = [line for line in clean(0, **settings).trace if "declared dead" in line]
    assert len(dead) == 1 and "port s1 closed" in dead[0], dead
    real = Liveness.probe_answered
    monkeypatch.setattr(Liveness, "probe_answered", lambda self, server_id, boot, closed, *, now:
                        real(self, server_id, boot, None if closed else closed, now=now))  # "closed": unknown
    fires("L6", range(2), **settings)
