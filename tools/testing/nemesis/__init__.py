"""``tigana bench nemesis [--quick]``: a nemesis suite on real processes, checked by ledgers.

The cluster is started through the command line exactly as the README's cluster section says (``tigana
scheduler``, then ``tigana server --scheduler ...`` for each of ``--servers``), and the ledger clients start
right after, as a user's would: no wait for the cluster to settle. Two ledger tables, one ``sync`` and one
``async``, are written by ``--clients`` clients each (every acknowledged push adds exactly 1 to its ids' rows).

Then, in an order drawn from ``--seed``: a first round of every planned operation and no fault (create, use and
drop a scratch table; ``admin move-slot`` with and without ``--primary``, also to a server that already holds a
copy; ``rebalance``; ``drain``; a server joining; ``checkpoint``; ``export``; ``restore`` of a scratch table's
checkpoint), then rounds that mix them with faults (``kill -9``, SIGSTOP/SIGCONT, a restart on the old data dir)
until ``--duration`` has passed. The quick form runs the clean round and one round of the faults. One failure
at a time: before each fault the run waits until every slot has its in-sync copies again (``max_reprotect_s``;
``faults_unprotected`` counts faults that found the cluster still degraded after 60 s, a missed target),
since 1 + replicas copies promise to survive one failure, not a second one before the first is repaired.

A reader per table pulls the first ids back to back while all this goes on; every push's ids and times are
kept, and the record is checked per id as a counter history (``history``: stale, phantom and backwards
reads, after Porcupine and Knossos).

One JSON line (``case`` ``nemesis``; value: the longest push stall against 3x the heartbeat timeout) with
``lost_sync``, ``doubled_sync``, ``lost_async``, ``doubled_async``, ``linearizability_violations`` (sync) and
``linearizability_violations_async``, ``history_sync`` and ``history_async`` (the checker's counts), ``async_loss_bound`` (the replication lag
each killed or paused primary reported just before, plus what it acknowledged after that sample),
``primaries_killed``, ``lost_sync_before_faults`` and ``lost_async_before_faults`` (what a pull at the end of
the clean round misses of what was acknowledged before it), ``copies_demoted_without_failure`` (the
scheduler's ``copies_demoted`` counters outside the windows that run from a fault until the map is settled
again), ``max_push_stall_s`` (the longest a ledger client went without an acknowledgement, from its first one
on; the start-up wait for that first one is ``first_ack_s``) and where it fell, ``verify`` (``tigana admin
verify`` at the end: "ok" or what differs), ``rss_growth_mib`` (the daemons' resident memory growth), the
failed operations, the scheduler log's demotion reasons, ``ok`` and ``targets_missed``. The exit code is 1 when
a target is missed:

- sync: 0 lost, 0 doubled and 0 linearizability violations; the async history: no phantom read, and no
  violation unless a primary was killed, then no read lacking more than the bound; async: 0 doubled, 0 lost by the clean round, and 0 lost at the end unless a
  primary was killed, then within the bound;
- 0 copies demoted without a failure;
- the longest push stall under 3x the heartbeat timeout;
- ``admin verify`` finds every copy equal, every planned operation succeeds, no ledger row is torn.
- every fault found the cluster whole (no slot short of its in-sync copies) within 60 s.

Every process the run starts (daemons, admin commands) is stopped by its own handle, also when it fails.
"""

from tigana.tools.testing.nemesis.bench import KEYS, add_arguments, run, targets_missed

__all__ = ["KEYS", "add_arguments", "run", "targets_missed"]
