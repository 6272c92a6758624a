"""One point of a ``bench scale`` curve: its cluster and client processes, its timed repeats (interleaved with
the curve's other points) and its JSON lines against the curve's first point."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

from tigana.tools.bench.report import emit
from tigana.tools.bench.scale.clients import _Worker
from tigana.tools.bench.scale.cluster import _Cluster
from tigana.tools.bench.scale.resources import process_cpu_s
from tigana.tools.bench.scale.workload import KINDS

_LABELS = {"shards": "shard", "clients": "client", "rows": "rows", "batch": "batch"}


@dataclasses.dataclass
class _Point:
    curve: str
    x: int
    cluster: _Cluster
    workers: list[_Worker]
    batch: int
    key: str
    unit_batches: int = 0
    unique_ids: int = 0
    samples: dict[str, list[tuple[int, float, float, float]]] = dataclasses.field(
        default_factory=lambda: {k: [] for k in KINDS})  # (rows, wall s, client CPU s, server CPU s)

    def prepare(self, args: argparse.Namespace, unit_rows: int) -> None:
        self.unit_batches = max(2, -(-unit_rows // self.batch))
        count = min(8, max(2, self.unit_batches))
        for w in self.workers:
            w.send(op="prepare", key=self.key, addresses=self.cluster.addresses, dim=args.dim, batch=self.batch,
                   num_ids=self.cluster.rows, zipf=args.zipf, count=count, seed=1000 * self.workers.index(w) + 7)
        self.unique_ids = round(statistics.mean(w.recv()["unique_ids"] for w in self.workers))

    def unit(self, kind: str) -> tuple[int, float, float, float]:
        """One timed repeat: every client process runs ``unit_batches`` batches of ``kind`` at once."""
        servers = self.cluster.pids
        s0 = sum(map(process_cpu_s, servers))
        t0 = time.perf_counter()
        for w in self.workers:
            w.send(op="run", key=self.key, kind=kind, batches=self.unit_batches)
        replies = [w.recv() for w in self.workers]
        wall = time.perf_counter() - t0
        s1 = sum(map(process_cpu_s, servers))
        return sum(r["rows"] for r in replies), wall, sum(r["cpu_s"] for r in replies), s1 - s0

    def release(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.call(op="release", key=self.key)

    def figures(self, kind: str) -> dict[str, float]:
        s = self.samples[kind]
        rows = sum(r for r, _, _, _ in s)
        client_cpu = sum(c for _, _, c, _ in s)
        server_cpu = sum(v for _, _, _, v in s)
        return {"rows_per_s": statistics.median(r / w for r, w, _, _ in s),
                "cpu_per_m": (client_cpu + server_cpu) / rows * 1e6,
                "client_cpu_per_m": client_cpu / rows * 1e6, "server_cpu_per_m": server_cpu / rows * 1e6,
                "rows_timed": rows}


def _measure(points: list[_Point], repeats: int) -> None:
    """A warm-up repeat of every (point, case), then ``repeats`` rounds, the points' order rotating each round."""
    for p in points:
        for kind in KINDS:
            p.unit(kind)
    for r in range(repeats):
        for k in range(len(points)):
            p = points[(r + k) % len(points)]
            for kind in KINDS:
                p.samples[kind].append(p.unit(kind))


def _peer_label(curve: str, x: int) -> str:
    if curve in ("shards", "clients"):
        return f"{x} {_LABELS[curve]}{'s' if x != 1 else ''} (same run)"
    if curve == "rows":
        return f"{x:,} resident rows (same run)"
    return f"batch of {x:,} ids (same run)"


def _emit_curve(points: list[_Point], base: dict) -> list[dict]:
    lines = []
    first = points[0]
    for kind in KINDS:
        peer = first.figures(kind)
        for p in points:
            f = p.figures(kind)
            params = dict(curve=p.curve, shards=p.cluster.shards, clients=len(p.workers), rows=p.cluster.rows,
                          batch=p.batch, unique_ids=p.unique_ids, **base,
                          client_cpu_s_per_m=round(f["client_cpu_per_m"], 4),
                          server_cpu_s_per_m=round(f["server_cpu_per_m"], 4), rows_timed=f["rows_timed"])
            label = _peer_label(p.curve, first.x)
            lines.append(emit(f"scale.{p.curve}.{kind}", "rows/s", f["rows_per_s"], label, peer["rows_per_s"],
                              **params))
            lines.append(emit(f"scale.{p.curve}.{kind}", "cpu_s/M rows", f["cpu_per_m"], label, peer["cpu_per_m"],
                              **params))
    if first.curve == "rows":
        for p in points:
            lines.append(emit("scale.rows.memory", "bytes/row", p.cluster.bytes_per_row,
                              _peer_label("rows", first.x), first.cluster.bytes_per_row, curve="rows",
                              shards=p.cluster.shards, rows=p.cluster.rows,
                              rss_growth_bytes_per_row=round(p.cluster.rss_growth / p.cluster.rows, 1),
                              dim=base["dim"], optimizer=base["optimizer"], quick=base["quick"],
                              full=base["full"]))
    return lines
