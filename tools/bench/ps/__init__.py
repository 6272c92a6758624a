"""``tigana bench ps``: the tigana.ps client against 2 shard daemons on loopback, with its limits and a peer.

Workload: batches of 65,536 ids drawn Zipf(1.05) over 10M ids; dim 16 and 64; fp32 and fp16 on the wire.
Cases (rows = ids in the batch, duplicates included, per second):

- ``pull``  ``client.pull`` of one batch;
- ``push``  pushes of Adagrad gradients, counted once acknowledged (4 in flight, then ``flush``);
- ``step``  pull, then push of the batch (staleness 1, as a trainer that overlaps its pushes).

Each case is reported against three references measured in the same run, one JSON line each:

- ``in-process``  the same tables as ``EmbeddingTable`` in this process, no network (the limit);
- ``grpc-echo``   the same messages (sizes, chunks, 2 servers, same channel options) as raw bytes through a
                  generic-handler echo service in 2 child processes (the Python gRPC ceiling of unary calls);
- ``grpc-stream-echo``  the same bytes as frames of one bidirectional stream per echo server (the ceiling
                  of the streaming data path the client uses by default);
- ``ps-unary``    the same client with ``transport="unary"`` (one RPC per message);
- ``redis``       ``redis-server`` on a free loopback port, pipelined MGET/MSET of the unique ids' rows as
                  packed bytes (skipped with a message on stderr when the binary is absent).

The timed runs of a case and its three references are interleaved round-robin (medians reported), so all see the
same load on a shared machine. Every process involved (client, daemons, echo servers) runs with ``tigana.ps.allocator.tune_allocator``'s large-buffer
malloc thresholds (glibc otherwise maps and unmaps every multi-MiB gRPC buffer, which costs ~3x on loopback).

Rooms: ``bench`` (the command: arguments, the run, the cases of one table), ``workload`` (the Zipf batches and
the interleaved timing), ``echo`` (the raw gRPC ceiling), ``redis_peer`` (the Redis peer), ``replication``
(``--replicas``: sync and async replication against none).
"""

from tigana.tools.bench.ps.bench import add_arguments, run
from tigana.tools.bench.ps.echo import EchoServers
from tigana.tools.bench.ps.redis_peer import RedisPeer
from tigana.tools.bench.ps.workload import interleaved_rates, zipf_batches

__all__ = ["EchoServers", "RedisPeer", "add_arguments", "interleaved_rates", "run", "zipf_batches"]
