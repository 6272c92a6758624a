"""``tigana bench scale --tiered``: a table past RAM, most of its rows in the spill tier on disk.

``--tiered-rows`` distinct ids (default 250 M) of dim ``--tiered-dim`` (16, row-wise Adagrad) through
``--tiered-shards`` daemons (2), each started with ``--memory-budget`` (4 GiB) and ``--snapshot-every`` (60 s, the
server's default): past the budget a daemon spills its coldest rows to its spill file, and its periodic snapshots
(a full one, then increments) read the table through cuts while the inserts go on. Beside it, in the same run, a
reference cluster of as many daemons without a budget or snapshots holds ``--ram-rows`` (10 M) rows in RAM. The
same shape at a smaller size: scale ``--tiered-rows``, ``--memory-budget``, ``--ram-rows`` and ``--snapshot-every``
down together (docs/benchmarks.md: 20 M rows, 328 MiB, 800 k, 5 s). One JSON line per case:

- ``scale.tiered.insert`` (rows/s): first-sight pulls of the ids (65,536 a batch, two batches in flight),
  against the same inserts into the reference cluster. Progress (rate, RSS, resident and spilled rows) is
  logged every 5 %, so a run stopped early still says how it went.
- ``scale.tiered.pull`` / ``scale.tiered.push`` (rows/s): batches of Zipf(``--zipf``) ids over every row once
  all are in, against the same workload over the reference cluster's rows, interleaved; with the RAM tier's hit
  rate over the timed pulls (``ram_hit_rate``: ids found resident / ids looked up) and the rows that came back
  from the spill file meanwhile.
- ``scale.tiered.rss`` (bytes): the largest anonymous RSS of a daemon (``RssAnon`` + ``RssShmem``: its own memory, what the
  budget governs) from the tiered inserts to the end of the Zipf phase, sampled every 20 ms (``RssPeaks``: a
  spike that lasts a rehash counts), against its budget plus the daemon's anonymous RSS at start
  (``anon_at_start``); with the median along the run (``anon_median``, ``median_ratio``), the whole RSS
  (``rss_with_file_pages``: it also counts the spill file's pages the daemon has mapped and touched, page cache
  the kernel may take back) and the snapshots the daemons wrote meanwhile (``snapshots``).
- ``scale.tiered.disk`` (bytes/row): the spill tiers' files over the spilled rows, against the engine's bytes a
  resident row; ``data_dir_bytes_per_row`` is everything in the data directories (snapshots too) over all rows.

A benchmark, not a test: it needs disk (about 120 bytes a spilled row, and 200 a row for the snapshots) and
time. The machine's figures go in the README's capacity model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from tigana import ps
from tigana.embeddings.mixing import mix64
from tigana.tools.bench.ps.workload import _Cycle, interleaved_rates, zipf_batches
from tigana.tools.bench.report import emit, log, parse_counts
from tigana.tools.bench.scale.resources import RssPeaks, _rss_anon, _rss_bytes

TABLE = "tiered"
_BATCH = 1 << 16
_DISK_BYTES_PER_ROW = 120  # the disk check's estimate (a 104-byte record and slack); the run measures it
_SNAPSHOT_BYTES_PER_ROW = 200  # with snapshots: two full ones (about 100 bytes a row each) kept at a time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiered", action="store_true",
                        help="run the tiered case instead of the curves: a table past RAM, most rows in the spill tier on disk")
    parser.add_argument("--tiered-rows", default="250M", help="distinct ids of the tiered table (default 250M)")
    parser.add_argument("--memory-budget", default="4GiB", help="each tiered daemon's --memory-budget (4GiB)")
    parser.add_argument("--ram-rows", default="10M", help="rows of the in-RAM reference cluster (default 10M)")
    parser.add_argument("--tiered-shards", type=int, default=2, help="daemons of each cluster (default 2)")
    parser.add_argument("--tiered-dim", type=int, default=16, help="embedding dim of the tiered case (default 16)")
    parser.add_argument("--snapshot-every", type=float, default=60.0,
                        help="each tiered daemon's --snapshot-every in seconds (default 60, the server's default; "
                             "0: no periodic snapshots); at a smaller --tiered-rows, shorten it in proportion so "
                             "that as many snapshots overlap the inserts")
    parser.add_argument("--tiered-dir", default=None,
                        help="where the clusters keep their data (default: a temporary directory)")


def run_tiered(args: argparse.Namespace) -> int:
    rows, ram_rows = parse_counts(args.tiered_rows)[0], parse_counts(args.ram_rows)[0]
    budget = ps.parse_bytes(args.memory_budget, field="--memory-budget")
    shards, dim = args.tiered_shards, args.tiered_dim
    every = float(args.snapshot_every)
    if every < 0:
        raise SystemExit(f"bench scale --tiered: --snapshot-every must be >= 0 (0: off), got {every}")
    work = Path(tempfile.mkdtemp(prefix="tigana-bench-tiered-", dir=args.tiered_dir))
    free = shutil.disk_usage(work).free
    need = rows * (_DISK_BYTES_PER_ROW + (_SNAPSHOT_BYTES_PER_ROW if every else 0))
    if need > free:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"bench scale --tiered: {rows:,} rows need about {need / 1e9:.0f} GB of disk in "
                         f"{work.parent}; {free / 1e9:.0f} GB free (lower --tiered-rows, or --snapshot-every 0)")
    params = {"rows": rows, "dim": dim, "shards": shards, "memory_budget": budget, "ram_rows": ram_rows,
              "optimizer": "rowwise_adagrad", "zipf": args.zipf, "batch": _BATCH, "snapshot_every": every}
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
    tiered = ram = None
    clients: list[ps.Client] = []
    try:
        # The tiered daemons snapshot on their schedule (a snapshot's cut must hold the budget too); the reference
        # cluster does not: it is the speed of the same calls in RAM.
        tiered = ps.LocalCluster(shards, replicas=None, env=env, memory_budget=str(budget),
                                 data_dir=work / "tiered", server_args=["--snapshot-every", f"{every:g}"])
        ram = ps.LocalCluster(shards, replicas=None, env=env, data_dir=work / "ram",
                              server_args=["--snapshot-every", "0"])
        for cluster in (tiered, ram):
            client = ps.connect(cluster.addresses)
            client.wait_ready(60)
            client.create_table(TABLE, dim=dim, optimizer=ps.RowWiseAdagrad(lr=0.01), staleness=1)
            clients.append(client)
        pids = [p.pid for p in tiered.procs]
        rss0 = max(_rss_bytes(pid) for pid in pids)
        anon0 = max(_rss_anon(pid) for pid in pids)
        ram_rate = _insert(clients[1], ram_rows, [p.pid for p in ram.procs], "reference")
        with RssPeaks(pids) as peaks:
            rate = _insert(clients[0], rows, pids, "tiered")
            emit("scale.tiered.insert", "rows/s", rate, f"the same inserts into RAM ({ram_rows:,} rows, no budget)",
                 ram_rate, **params)
            _zipf_phase(args, clients, rows, ram_rows, params)
        emit("scale.tiered.rss", "bytes", peaks.anon_max, "memory budget + anonymous RSS at start", budget + anon0,
             anon_at_start=anon0, rss_at_start=rss0, anon_median=peaks.anon_median,
             median_ratio=round(peaks.anon_median / (budget + anon0), 3), rss_with_file_pages=peaks.rss_max,
             rss_samples=peaks.samples, snapshots=_snapshots_written(work / "tiered"), **params)
        stats = _stats(clients[0])
        spill = sum(_du(p) for p in (work / "tiered").glob("shard-*/spill"))
        disk = _du(work / "tiered")
        emit("scale.tiered.disk", "bytes/row", spill / max(1.0, stats["rows_spilled"]),
             "engine bytes a resident row", stats["bytes_resident"] / max(1.0, stats["rows_resident"]),
             spill_bytes=spill, data_dir_bytes_per_row=round(disk / rows, 1), rows_resident=int(stats["rows_resident"]),
             rows_spilled=int(stats["rows_spilled"]), **params)
    finally:
        for client in clients:
            with contextlib.suppress(ps.PSError):
                client.close()
        for cluster in (tiered, ram):
            if cluster is not None:
                cluster.close(timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _ids(start: int, stop: int) -> np.ndarray:
    """The run's distinct ids of ranks start .. stop-1."""
    return _ids_of_ranks(np.arange(start, stop, dtype=np.uint64))


def _insert(client: ps.Client, rows: int, pids: list[int], what: str) -> float:
    """First-sight pulls of ids 0 .. rows-1 (by rank), two batches in flight; rows/s."""
    t0 = time.perf_counter()
    pending: list = []
    step, next_log = max(_BATCH, rows // 20), 0
    for start in range(0, rows, _BATCH):
        pending.append(client.pull_async(TABLE, _ids(start, min(rows, start + _BATCH))))
        if len(pending) >= 2:
            pending.pop(0).result()
        if start >= next_log:
            rss = [_rss_bytes(pid) for pid in pids]
            anon = [_rss_anon(pid) for pid in pids]
            if start:
                st = _stats(client)
                log(f"bench scale --tiered ({what}): {start / 1e6:.1f} M rows in {time.perf_counter() - t0:.0f}s "
                    f"({start / (time.perf_counter() - t0) / 1e6:.2f} M rows/s), resident "
                    f"{st['rows_resident'] / 1e6:.1f} M, spilled {st['rows_spilled'] / 1e6:.1f} M, RSS "
                    f"{', '.join(f'{r / 2**30:.2f}' for r in rss)} GiB (anonymous "
                    f"{', '.join(f'{r / 2**30:.2f}' for r in anon)})")
            next_log += step
    for fut in pending:
        fut.result()
    return rows / (time.perf_counter() - t0)


def _zipf_phase(args: argparse.Namespace, clients: list[ps.Client], rows: int, ram_rows: int, params: dict) -> None:
    """Pull and push rows/s under Zipf ids over every row, tiered against in RAM, interleaved."""
    count = 4 if args.quick else 8
    repeats = args.repeats or (3 if args.quick else 7)
    workloads = []
    for client, n in zip(clients, (rows, ram_rows), strict=True):
        ranks = zipf_batches(count, _BATCH, n, args.zipf, seed=3)  # ranks in [0, n), scattered
        workloads.append((client, _Cycle([_ids_of_ranks(r) for r in ranks])))
    rng = np.random.default_rng(5)
    grads = _Cycle([rng.normal(0, 0.01, (_BATCH, args.tiered_dim)).astype(np.float32) for _ in range(count)])

    def puller(client: ps.Client, batches: _Cycle):
        def fn() -> int:
            client.pull(TABLE, batches())
            return _BATCH
        return fn

    def pusher(client: ps.Client, batches: _Cycle):
        def fn() -> int:
            for _ in range(4):
                client.push(TABLE, batches(), grads())
            client.flush()
            return 4 * _BATCH
        return fn

    before = _stats(clients[0])
    pulls = interleaved_rates({"tiered": puller(*workloads[0]), "ram": puller(*workloads[1])}, repeats)
    after = _stats(clients[0])
    lookups = after["lookups"] - before["lookups"]
    hit_rate = (after["hits"] - before["hits"]) / lookups if lookups else 0.0
    pushes = interleaved_rates({"tiered": pusher(*workloads[0]), "ram": pusher(*workloads[1])}, repeats)
    peer = f"the same workload in RAM ({ram_rows:,} rows)"
    emit("scale.tiered.pull", "rows/s", pulls["tiered"], peer, pulls["ram"], ram_hit_rate=round(hit_rate, 4),
         unspilled_rows=int(after["unspills"] - before["unspills"]), repeats=repeats, **params)
    emit("scale.tiered.push", "rows/s", pushes["tiered"], peer, pushes["ram"], repeats=repeats, **params)


def _ids_of_ranks(ranks: np.ndarray) -> np.ndarray:
    """The ids of ``ranks``: splitmix of the rank, so they are spread like hashed features."""
    return mix64(ranks.astype(np.uint64)).view(np.int64)


def _stats(client: ps.Client) -> dict[str, float]:
    """The table's counters summed over the cluster's servers (``describe_table``: no checksum pass, which
    would read every spilled row)."""
    return client.describe_table(TABLE).stats


def _snapshots_written(data_dir: Path) -> int:
    """Snapshots the daemons under ``data_dir`` have written so far, summed over them: a table's snapshots are
    numbered in sequence and pruning keeps the latest, so the largest number of each is its count."""
    seqs: dict[Path, int] = {}
    for manifest in data_dir.glob("shard-*/**/manifest.json"):
        name = manifest.parent.name
        if name[:8].isdigit():
            seqs[manifest.parent.parent] = max(seqs.get(manifest.parent.parent, 0), int(name[:8]))
    return sum(seqs.values())


def _du(path: Path) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks, as ``du`` counts them)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total

