"""tigana.ps.shard — the shard server: a gRPC adapter over the storage engine's tables, the copies of slots it
holds, and the replication between copies.

Each handler decodes the request with ``tigana.ps.wire.data``, checks it against the table and the shard map, calls
the table, and encodes the answer. Every exception a handler raises becomes a gRPC status in one place
(``_rpc``, through ``errors.to_status``); a bug answers INTERNAL and the server keeps serving. Validation
happens before anything changes, so a rejected request leaves every table as it was.

Two modes:

- static (a shard list): the server leads the slots of ``ServerConfig.slots``; no replication; epoch 0.
- cluster (``ServerConfig.scheduler``): the scheduler's ``ShardMap`` says which slots this server leads and
  which it holds as a copy. ``install`` applies a new map under every table's write lock, so a request is
  checked and applied against one map. The server serves only once the map names its current boot: a
  restarted server never serves rows of its previous life before the scheduler has decided about them.

The write path of a cluster table (``Push``; pulls that insert take the same path without waiting):
under the table's write lock, check that this server leads every slot of the request in its current map
(``WrongShard`` otherwise, with the epoch; the leads check and the apply see the same map), check
``min_copies``, skip slots that already applied this (client id, seq), apply, record the key, stamp the
slots' log positions and enqueue the changed rows to every copy (``replication``). Then, for a sync table,
wait until every in-sync copy applied it (invariant I1 of ``replication``), and acknowledge only if the
slots' copies did not change meanwhile (otherwise the client retries and the retry is answered as a
duplicate once the copies of the new map have it).

Thread-safety: handlers run on gRPC's thread pool, except ``Replicate`` and ``InstallMap``, which run on a
control pool of their own (a unary sync push waiting for its copies holds a thread of the first). Each table
has a write lock (``_Hosted.lock``) held for check-apply-record-enqueue; ``install`` takes all of them (in name
order) after the install lock; the registry lock serializes create/drop/restore. No RPC and no wait runs under
a table or install lock: a map's replication actions (reports to the scheduler among them) run once they are
released.

One room per concept, assembled into the one class ``ShardService`` (each room a mixin over the fields
declared in ``_fields``):

- ``hosted``: a table as served (``_Hosted``), table creation, drop and memory budget, ``checksum_value``;
- ``ownership``: what this server leads and holds (``_View``), the leads check, the map install and the
  hand-over of the primary role;
- ``writes``: the write path (pull, push: apply then acknowledge) and its replication to the copies;
- ``export``: whole-table reads and writes (``ExportRows``, ``ImportRows``), ``SlotInfo`` and ``Stats``;
- ``cuts``: cluster cuts (``PrepareCut``, ``CommitCut``, ``ReleaseCut``): every table at one point of the
  cluster's history, for ``tigana admin checkpoint``;
- ``persistence``: snapshots, restore, loading at start, quarantine, the table registry;
- ``service``: ``ShardService`` with the remaining RPC handlers, ``add_to_server``, ``SERVICE_NAME``; the
  handlers' error guard is ``_guard``.

Around it: ``config`` (``ServerConfig``, ``load_server_config``), ``daemon`` (``start_server`` and its
``ServerHandle``: the gRPC server, the membership agent, metrics), ``catalog`` (a table's slot logs, dedup
windows and snapshots), ``dedup`` (the exactly-once window per slot) and ``warmup`` (kernels compiled before
the server registers).
"""

from tigana.ps.shard.hosted import checksum_value
from tigana.ps.shard.service import SERVICE_NAME, ShardService, add_to_server

__all__ = ["SERVICE_NAME", "ShardService", "add_to_server", "checksum_value"]
