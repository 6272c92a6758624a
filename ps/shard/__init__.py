"""tigana.ps.shard — the shard server: a gRPC adapter over the storage engine's tables, the copies of slots it
holds, and the replication between copies.

Each handler decodes the request with ``tigana.ps.wire.data``, checks it against the table and the shard map, calls
the table, and encodes the answer. Every exception a handler raises becomes a gRPC status in one place
(``_guard._rpc``, through ``errors.to_status``); a bug answers INTERNAL and the server keeps serving. Validation
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
has a write lock (``_Hosted.lock``) held for check-apply-record-enqueue; ``Ownership.install`` takes all of
them (in name order) after the install lock; the registry lock (``HostedTables.lock``) serializes
create/drop/restore. No RPC and no wait runs under a table or install lock: a map's replication actions
(reports to the scheduler among them) run once they are released.

One room per concept, each an object with explicit constructor dependencies and a public API (what, why,
locks, blocking in each docstring); a simulator or a test drives them without gRPC:

- ``links``: ``ServerLinks``, the lifecycle state and the link to the scheduler (the daemon's agent), where
  the replicator's callbacks go (never back into the server's objects);
- ``view``: ``View`` (what this server holds under one map), ``Holdings`` (the current view and the leads
  check) and ``check_unmoved`` (may a write that waited for its copies be acknowledged);
- ``hosted``: a table as served (``_Hosted``), ``HostedTables`` (the registry: create, drop, look-up, memory
  budget, the registry file), ``checksum_value``;
- ``persistence``: ``Persistence``, snapshots, restore, loading at start, quarantine;
- ``ownership``: ``Ownership``, the map install, the deletion of rows no longer held, the hand-over of the
  primary role, periodic upkeep;
- ``writes``: ``WritePath``, pull and push (apply then acknowledge) and their replication to the copies;
  ``copy_slot_rows``, a slot copy's rows;
- ``export``: ``Exports``, whole-table reads and writes (``ExportRows``, ``ImportRows``), ``SlotInfo``, ``Stats``;
- ``cuts``: ``Cuts``, cluster cuts (``PrepareCut``, ``CommitCut``, ``ReleaseCut``): every table at one point
  of the cluster's history, for ``tigana admin checkpoint``;
- ``receiver``: ``Receiver``, the replication streams into this server (``Replicate``);
- ``service``: ``ShardService``, the gRPC adapter that builds the objects above, decodes each request, calls
  them and encodes the answer; ``add_to_server``, ``SERVICE_NAME``; the handlers' error guard is ``_guard``;
  ``streams``: the server's side of the ``Exchange`` stream; ``multitable``: its frames carrying several
  tables' parts (checked whole, applied and answered per part); ``tablelock``: a table's write lock.

Dependencies point one way: ``links`` <- ``view`` <- ``hosted`` <- ``persistence`` <- ``ownership``;
``writes`` <- ``export`` (with ``cuts``); ``service`` builds them all.

Around it: ``config`` (``ServerConfig``, ``load_server_config``), ``daemon`` (``start_server`` and its
``ServerHandle``: the gRPC server, the membership agent, metrics), ``catalog`` (a table's slot logs, dedup
windows and snapshots), ``dedup`` (the exactly-once window per slot) and ``warmup`` (kernels compiled before
the server registers).
"""

from tigana.ps.shard.hosted import checksum_value
from tigana.ps.shard.service import SERVICE_NAME, ShardService, add_to_server

__all__ = ["SERVICE_NAME", "ShardService", "add_to_server", "checksum_value"]
