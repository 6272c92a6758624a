"""``Receiver``: the replication streams into one shard server (the ``Replicate`` RPC's body): each primary's
stream applied in order (``replication.apply``: invariant I3), one lane at a time: the change lane, and the copy
lane (a slot copy's rows), whose items wait for the change lane (S11).
"""

from __future__ import annotations

import threading
from typing import Any

from tigana.proto import shard_pb2 as pb
from tigana.ps.replication import Inbound, apply_item, copy_lane_ready
from tigana.ps.replication.actions import RefreshMap
from tigana.ps.shard.hosted import HostedTables
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.view import Holdings
from tigana.ps.wire import cluster as cluster_wire

__all__ = ["Receiver"]


class Receiver:
    """The inbound replication state of one shard server, per source and lane.

    Dependencies: ``tables`` (where items apply), ``holdings`` (the map they are checked against) and ``links``
    (a source with a newer map has the agent fetch it first). Thread-safety: any thread; one stream's requests
    apply one at a time, in order (a lock per source and lane). Blocking: an item waits for its table's write
    lock; a request from a source with a newer map waits up to 2 s for this server to install it (no lock
    held but the stream's own)."""

    def __init__(self, server_id: str, tables: HostedTables, holdings: Holdings, links: ServerLinks) -> None:
        self.server_id, self.tables, self.holdings, self.links = server_id, tables, holdings, links
        self.num_slots = tables.num_slots
        self._inbound: dict[str, tuple[Inbound, threading.Lock]] = {}
        self._lock = threading.Lock()

    def receive(self, request: pb.ReplicateRequest | cluster_wire.RawReplicate) -> pb.ReplicateResponse:
        """Apply one replication request of a primary's stream (``request.lane``: 0 change, 1 copy) and answer
        it (applied up to, behind, or refused as stale: ``replication.Inbound``)."""
        source, lane = request.source, int(getattr(request, "lane", 0))
        with self._lock:
            change = self._lane(source, source)[0]
            st, lock = self._lane(f"{source}\0copy", source) if lane else self._inbound[source]

        ready = copy_lane_ready(change, request.source_boot, request.generation)

        def view() -> Any:
            return self.holdings.view

        def apply_one(msg: Any, epoch: int) -> Any:
            return apply_item(msg, source, epoch, self.tables.find, view, self.num_slots,
                              generation=request.generation, copy_ready=ready if lane else None)

        with lock:  # one stream's requests apply one at a time, in order
            out = st.receive(request, self.server_id, view, apply_one)
            if isinstance(out, RefreshMap):  # the source's map is newer: learn it, then apply (or refuse BEHIND)
                self.links.refresh(out.epoch, 2.0)
                out = st.receive(request, self.server_id, view, apply_one, may_refresh=False)
        return out

    def _lane(self, key: str, source: str) -> tuple[Inbound, threading.Lock]:
        """The state and lock of one lane of ``source``'s stream (``_lock`` held), made on its first request
        (not on every one: ``setdefault`` would build a new pair each time)."""
        got = self._inbound.get(key)
        if got is None:
            got = self._inbound[key] = (Inbound(source), threading.Lock())
        return got
