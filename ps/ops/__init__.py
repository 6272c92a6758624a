"""tigana.ps.ops — operating clusters from outside them: ``local`` launches one on this machine (``LocalCluster``,
``LocalEtcd``: a scheduler and shard daemons as child processes, for ``tigana local``, the tests and the
benchmarks), ``admin`` is an operator's client of a live one (``cluster_status``, ``verify``, ``wait_for``,
behind ``tigana admin``).

Neither runs in a server: they start servers as processes and talk to them over gRPC, as a user would.
"""

from tigana.ps.ops.local import LocalCluster, LocalEtcd

__all__ = ["LocalCluster", "LocalEtcd"]
