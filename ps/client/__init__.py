"""tigana.ps.client — the client trainers use: pull rows from and push gradients to the shard servers that
lead them.

A batch of ids is deduplicated, routed id -> slot -> server, sent to every primary in parallel (one RPC per
server, more only when a batch is above ``ClientConfig.chunk_bytes``) and reassembled in the order of the ids.
With a scheduler the client follows its shard map (``mapfollower``): a message refused with ``WrongShard``,
or sent to a server that died, is routed again by the newest map, transparently, with the same (client id,
seq), which the servers apply exactly once. Pushes are asynchronous and bounded per server; pulls honour the
table's staleness bound against this client's own pushes. Every call has a deadline; every gRPC error
reaches the user as a ``tigana.ps`` exception.

Thread-safety: a ``Client`` may be shared by threads; results are delivered through
``concurrent.futures.Future`` objects completed on gRPC callback threads.

The client imports nothing of the server (an import-linter contract keeps it so); what both sides speak
lives in the shared modules of ``tigana.ps`` (``wire``, ``frames``, ``routing``, ``errors``, ``channels``).
One room per concept:

- ``facade``: ``Client`` (connection, routing, lifecycle), assembled from ``datapath`` (pull, push, flush),
  ``tables`` (create, describe, drop, list, per-table settings, checkpoints) and ``operations`` (snapshots,
  restores, counters) over the fields declared in ``_fields``; and ``connect``;
- ``config``: ``ClientConfig`` and ``Compression``;
- ``tablestate``: what the client keeps per table, and the staleness bound;
- the data path underneath: ``routes`` (``Route``, ``Server``), ``inflight`` (pulls and pushes in flight,
  re-routing), ``exchange`` (the streaming transport);
- ``mapfollower``: the client's copy of the scheduler's shard map.
"""

from tigana.ps.client.config import ClientConfig, Compression
from tigana.ps.client.facade import Client, connect
from tigana.ps.client.tables import TableInfo

__all__ = ["Client", "ClientConfig", "Compression", "TableInfo", "connect"]
