"""The shard daemons of a ``bench scale`` point, their rows pre-loaded before anything is timed."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from tigana import ps
from tigana.tools.bench.report import log
from tigana.tools.bench.scale.resources import _bytes_per_row_estimate, _mem_available, _rss_bytes
from tigana.tools.bench.scale.workload import TABLE, _create_table


class _Cluster:
    """``shards`` static daemons holding ``rows`` resident rows (ids 0 .. rows-1) of the table."""

    def __init__(self, shards: int, rows: int, dim: int) -> None:
        need = rows * _bytes_per_row_estimate(dim)
        avail = _mem_available()
        if avail is not None and need * 1.15 + (1 << 30) > avail:
            raise SystemExit(f"bench scale: {rows:,} resident rows at dim {dim} need about {need / 1e9:.1f} GB "
                             f"of RAM; {avail / 1e9:.1f} GB available (lower --rows, or drop --full)")
        self.shards, self.rows = shards, rows
        env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
        t0 = time.perf_counter()
        self.local = ps.LocalCluster(shards, replicas=None, env=env)
        self.client: ps.Client | None = None
        try:
            self.pids = [p.pid for p in self.local.procs]
            self.client = ps.connect(self.local.addresses)
            self.client.wait_ready(60)
            _create_table(self.client, dim)
            rss0 = sum(_rss_bytes(pid) for pid in self.pids)
            t1 = time.perf_counter()
            self._preload(rows)
            t2 = time.perf_counter()
            self.rss_growth = sum(_rss_bytes(pid) for pid in self.pids) - rss0
            stats = self.client.server_stats(TABLE)
            tables = [per[TABLE] for per in stats.values()]
            resident = sum(t["rows_resident"] for t in tables)
            if int(resident) != rows:
                raise RuntimeError(f"bench scale: pre-load left {resident:.0f} resident rows, expected {rows}")
            self.bytes_per_row = sum(t["bytes_resident"] for t in tables) / resident
            log(f"bench scale: {shards} shard(s) up in {t1 - t0:.1f}s; {rows:,} rows pre-loaded in {t2 - t1:.1f}s "
                f"({rows / (t2 - t1) / 1e6:.2f} M rows/s), engine {self.bytes_per_row:.0f} bytes/row, "
                f"RSS grew {self.rss_growth / rows:.0f} bytes/row")
        except BaseException:
            self.close()
            raise

    def _preload(self, rows: int, chunk: int = 1 << 19, in_flight: int = 2) -> None:
        """Insert ids 0 .. rows-1 with pulls of sequential ranges, ``in_flight`` at a time."""
        assert self.client is not None
        pending = []
        for start in range(0, rows, chunk):
            pending.append(self.client.pull_async(TABLE, np.arange(start, min(rows, start + chunk), dtype=np.int64)))
            if len(pending) >= in_flight:
                pending.pop(0).result()
        for fut in pending:
            fut.result()

    @property
    def addresses(self) -> list[str]:
        return self.local.addresses

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        self.local.close(timeout=30)
