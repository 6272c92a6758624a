"""``tigana bench scale``: how the cost of pull, push and step grows with the work, as four curves.

Workload (the issue's headline): dim 64, fp32 on the wire, Adagrad, ids drawn Zipf(1.05) over the resident rows
(``tigana.tools.bench.ps.zipf_batches``), staleness 1 (as ``bench ps``: a trainer that overlaps its pushes),
static shard daemons (``ps.LocalCluster(n, replicas=None)``) and the client's defaults otherwise (streams,
4 MB chunks, 8 pushes in flight per server). Cases, as in ``bench ps``:

- ``pull``  ``client.pull`` of each batch;
- ``push``  a push of Adagrad gradients for each batch, then ``flush`` (counted once acknowledged);
- ``step``  pull, then push of each batch, then ``flush``.

Curves (defaults; ``--quick`` / ``--full`` / the size flags change them):

- ``shards``   1, 2, 4 shard daemons (1 client, 1 M resident rows, batches of 65,536 ids);
- ``clients``  1, 2, 4 client processes running the same workload at once, each its own ``ps.Client`` in its own
               process, with its own Zipf draw (2 shards, 1 M rows, batches of 65,536);
- ``rows``     1 M and 10 M resident rows, 100 M with ``--full`` (100 k and 1 M with ``--quick``); 2 shards,
               1 client, batches of 65,536; plus the engine's bytes per resident row at each size;
- ``batch``    batches of 4,096, 16,384, 65,536 and 262,144 ids (2 shards, 1 client, 1 M rows).

Each point gives two figures per case, one JSON line each:

- ``rows/s``        ids per wall second (duplicates included, all client processes together; the median of the
                    timed repeats);
- ``cpu_s/M rows``  CPU seconds (user + system, every thread) of every process involved, per million rows, over
                    all timed repeats: each client process (its own ``getrusage``, to the microsecond) and each
                    shard daemon of the point (``/proc/<pid>/stat`` utime + stime, read right before and after
                    each timed repeat). ``client_cpu_s_per_m`` and ``server_cpu_s_per_m`` split it; the
                    coordinating process (this one) only waits on pipes and is not counted.

Why both: the development machine has 2 cores shared with other jobs, so rows/s measures how busy the machine was
as much as the system (4 shards and a client cannot run faster than 2 cores; a neighbour's build slows any point).
CPU-seconds per row do not depend on how many cores there are or on who else runs, so they are the figure to
extrapolate past this box: a server core serves about 1 / ``server_cpu_s_per_m`` million rows per second (see the
README's capacity model). They still move somewhat with cache pressure and with gRPC's polling threads, and the
daemons' figure carries the kernel's 10 ms tick per reading, which is why a repeat moves at least ``--unit-rows``
ids per client.

Peer: the first point of the same curve, measured in the same run (1 shard, 1 client, the fewest resident rows,
the smallest batch), so ``ratio`` is the scaling factor of the curve (rows/s at 4 shards / rows/s at 1 shard; CPU
per row at 256 k ids / CPU per row at 4 k ids). The points of a curve are up at the same time and their timed
repeats interleave round-robin, so all see the same load.

Rows are pre-loaded by pulls of sequential id ranges (the Zipf ids are scattered over exactly that range) before
anything is timed, so the timed runs read and update existing rows (the table's initializer is Uniform: it only
sets how fast the pre-load goes). Memory: the engine holds about 575 bytes per resident row at dim 64 with Adagrad
(weights and the per-coordinate accumulator are 512 bytes; the rest is the slot header and the hash index), and
the daemons' RSS grows about 650 bytes per row; so the default (10 M rows) needs ~7 GB and ``--full`` (100 M rows)
about 65 GB of RAM. The run refuses a size that does not fit in the memory available, before starting anything.
Time on the 2-core development machine: ``--quick`` about a minute, the default about 8 minutes.

Rooms: ``bench`` (the command: arguments, sizes, the run), ``workload`` (curves, cases and their table),
``resources`` (CPU seconds and memory of processes), ``clients`` (the client processes), ``cluster`` (shard
daemons with their rows pre-loaded), ``points`` (one point of a curve: measured and emitted), ``figure``
(``--plot``).
"""

from tigana.tools.bench.scale.bench import add_arguments, run
from tigana.tools.bench.scale.figure import PLOT_EXTRA, plot
from tigana.tools.bench.scale.resources import process_cpu_s
from tigana.tools.bench.scale.workload import CURVES, KINDS, TABLE

__all__ = ["CURVES", "KINDS", "PLOT_EXTRA", "TABLE", "add_arguments", "plot", "process_cpu_s", "run"]
