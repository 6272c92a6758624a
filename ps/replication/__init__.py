"""Replication: a primary streams every state change of its slots, in order, to the other copies.

One ordered stream runs from a primary to each server holding copies of slots it leads (``stream``).
The protocol's decisions are sans-IO cores, events in and actions out, with no lock, thread, socket or clock
inside: the primary's side (``primary.Primary``: its streams, and the slot copies of ``copy``; the actions it
returns are in ``actions``) and the copy's apply side (``apply``). ``replicator.Replicator`` is the thin
thread and gRPC adapter that drives ``Primary`` in the daemon; the simulator (``tigana.tools.testing.sim``) drives the
same core on its own clock. Items
(see ``ReplicationItem`` in proto/shard.proto) carry rows and optimizer state as written, removals, admission
sightings and the exactly-once keys, never gradients; the target applies them in stream order (``apply``).
The slot copy is the same stream: ``SNAPSHOT_BEGIN`` on its change lane (the slots' starting log positions and
exactly-once keys), then ``SNAPSHOT_ROWS`` chunks and ``SNAPSHOT_END`` on its copy lane, each chunk exported
under the table's write lock and applied by the target after the changes queued before it, to the rows no later
change wrote or removed (``intake``), so writes never queue behind copied rows. Replica creation after a failure
and slot moves both use it.

Log positions (``log``): per table and slot every server keeps the position (epoch, index) of the last
write it holds; a target applies an item only when its positions equal the item's ``prev``.

The invariants that make "no acknowledged update is lost" true are written out, with where each is kept
and which test checks it, in docs/replication.md (I1-I7 there).
"""

from tigana.ps.replication.apply import Inbound, apply_item, copy_lane_ready
from tigana.ps.replication.copy import Session
from tigana.ps.replication.intake import CopyIntake
from tigana.ps.replication.log import NO_POSITION, SlotLog
from tigana.ps.replication.primary import Primary
from tigana.ps.replication.replicator import Replicator
from tigana.ps.replication.stream import Mark, Stream
from tigana.ps.wire.cluster import BARRIER, CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_END, SNAPSHOT_ROWS

__all__ = ["BARRIER", "CHANGES", "CopyIntake", "Inbound", "Mark", "NO_POSITION", "Primary", "Replicator", "SNAPSHOT_BEGIN", "SNAPSHOT_END",
           "SNAPSHOT_ROWS", "Session", "SlotLog", "Stream", "apply_item",
           "copy_lane_ready"]
