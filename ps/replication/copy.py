"""The slot copy: bringing a new copy of some slots on a target up to its primary, over the ordered stream.

Pure state and decisions (no lock, thread or clock: ``now`` comes in with each event). A ``Session`` is one
slot copy to one target. Its steps, each marked by a stream seq:

1. COPYING: ``SNAPSHOT_BEGIN`` is queued on the change lane (under the table locks, so it precedes every later
   write; its seq names the copy: ``copy_id``), then the rows on the copy lane, chunk by chunk, each exported
   under the table's write lock and stamped with the change-lane seq it was read after (``Item.after``): the
   target applies a chunk once its change lane got there, to the rows no change since the copy began wrote
   or removed (``replication.intake``), so writes never wait behind copied rows;
2. ROWS_SENT: ``SNAPSHOT_END`` queued on the copy lane (``end_seq``, a copy-lane seq);
3. SWITCHED: the target has applied every row (``end_seq`` acknowledged) and the change lane is nearly drained,
   or a second has passed since: sync writes to the slots now wait for the target (``required``), and
   everything queued before ``switch_seq`` must be applied before the copy may join the in-sync set;
4. REPORTED: ``switch_seq`` acknowledged; the primary reports the copy caught up (invariant I5). The
   scheduler puts it in the in-sync set, or refuses the report as stale (the session fails);
FAILED: refused by the target, a failed export, a stale report: the server's upkeep starts a new copy.

Switching a second after the rows were applied, whatever the lag, is what makes a copy finish under load:
writes faster than the target applies them would otherwise keep it catching up for ever. Once switched, sync
writes wait for the target, which slows them to its pace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

COPYING, ROWS_SENT, SWITCHED, REPORTED, FAILED = 1, 2, 3, 4, 5
SWITCH_LAG = 8  # items: a stream this close to drained switches at once


@dataclass(eq=False)  # compared by identity (``sess in stream.sessions``), never by value
class Session:
    """A slot copy to one target: its slots, progress, the map epoch it started at, and the seqs that mark
    its steps."""

    slots: np.ndarray
    tables: list[str]
    epoch: int = 0
    copy_id: int = 0  # the change-lane seq of its first SNAPSHOT_BEGIN: names the copy on both lanes
    state: int = COPYING
    end_seq: int = 0
    switch_seq: int = 0
    rows_sent: int = 0
    rows_total: int = 0
    rows_acked_at: float | None = None  # when the target had applied every row (SNAPSHOT_END acknowledged)
    started: float = 0.0
    # a planned move's copy, paced by the server's copy rate (``pacing``); False for one that restores a
    # missing replica (a slot had fewer in-sync copies than the cluster keeps when it started)
    paced: bool = True

    def fail(self) -> None:
        self.state = FAILED


def cut_to_catching(stream: Any, catching: np.ndarray) -> np.ndarray:
    """Keep a stream's live sessions, cut to their slots still catching up in the map (a copy the map removed
    is no reason to copy the others again: a new SNAPSHOT_BEGIN would empty copies that a report of this
    session may already have put in the in-sync set of a newer map). The catching slots no session covers:
    they need a new slot copy."""
    for x in stream.sessions:
        if x.state != FAILED and not catching[x.slots].all():
            x.slots = x.slots[catching[x.slots]]
    stream.sessions = [x for x in stream.sessions if x.state != FAILED and x.slots.size]
    covered = np.zeros(catching.shape[0], bool)
    for x in stream.sessions:
        covered[x.slots] = True
    return catching & ~covered


def pending_mask(stream: Any, catching: np.ndarray) -> np.ndarray:
    """Slots of copies switched or reported (awaiting the map's in-sync set) that the map still has catching up:
    the target must go on acknowledging their writes."""
    pending = np.zeros(catching.shape[0], bool)
    for sess in stream.sessions:
        if sess.state in (SWITCHED, REPORTED):
            pending[sess.slots] = True
    return pending & catching


def advance(stream: Any, now: float, switch_after_s: float) -> list[Session]:
    """After an acknowledgement (or a copy's last rows queued): move the stream's slot copies forward; the
    sessions that just reached REPORTED (to be reported caught up)."""
    report = []
    for sess in stream.sessions:
        if sess.state == ROWS_SENT and stream.copy_acked >= sess.end_seq and sess.rows_acked_at is None:
            sess.rows_acked_at = now
        if sess.state == ROWS_SENT and sess.rows_acked_at is not None and \
                (stream.lag <= SWITCH_LAG or now - sess.rows_acked_at >= switch_after_s):
            # From here on sync writes to these slots wait for the target; everything enqueued before this
            # point must be applied by it before it may join the in-sync set.
            stream.required[sess.slots] = True
            sess.switch_seq = stream.next_seq - 1
            sess.state = SWITCHED
        if sess.state == SWITCHED and stream.acked >= sess.switch_seq:
            sess.state = REPORTED
            report.append(sess)
    return report
