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
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import resource
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from tigana import ps
from tigana.ps.local import stop_process
from tigana.tools.bench.ps import zipf_batches
from tigana.tools.bench.report import emit, log

CURVES = ("shards", "clients", "rows", "batch")
KINDS = ("pull", "push", "step")
TABLE = "scale"
PLOT_EXTRA = "pip install 'tigana[plot]'  (matplotlib>=3.8)"
# Engine overhead per resident row beyond weights and optimizer state (slot header, hash index, slack): the
# memory check's estimate; the run measures the real figure (scale.rows.memory).
_ROW_OVERHEAD_BYTES = 64
_TICK = os.sysconf("SC_CLK_TCK")
_LABELS = {"shards": "shard", "clients": "client", "rows": "rows", "batch": "batch"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repeats (rows 100k and 1M; about a minute on 2 cores)")
    parser.add_argument("--full", action="store_true",
                        help="add 100M resident rows to the rows curve (needs about 65 GB of RAM)")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="write a 2x2 PNG of the curves (rows/s and CPU-s per M rows); needs the `plot` extra")
    parser.add_argument("--curves", default=",".join(CURVES), help="comma-separated curves to run")
    parser.add_argument("--shards", default="1,2,4", help="shard counts of the shards curve")
    parser.add_argument("--clients", default="1,2,4", help="client processes of the clients curve")
    parser.add_argument("--rows", default=None,
                        help="resident rows of the rows curve (default 1M,10M; quick 100k,1M; full adds 100M)")
    parser.add_argument("--batches", default="4096,16384,65536,262144", help="batch sizes of the batch curve")
    parser.add_argument("--base-rows", type=int, default=1_000_000,
                        help="resident rows of the shards, clients and batch curves")
    parser.add_argument("--base-shards", type=int, default=2, help="shards of the clients, rows and batch curves")
    parser.add_argument("--batch", type=int, default=65536, help="ids per batch of the shards, clients, rows curves")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per point and case (default 7, "
                                                                  "quick 3)")
    parser.add_argument("--unit-rows", type=int, default=None,
                        help="ids per client per timed repeat, at least 2 batches (default 1M, quick 256k)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a client process (internal)


# --- sizes ------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower().replace("_", "")
        if not part:
            continue
        scale = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000}.get(part[-1], 1)
        out.append(int(float(part[:-1] if scale > 1 else part) * scale))
    return out


def _sizes(args: argparse.Namespace) -> dict[str, list[int]]:
    if args.rows is not None:
        rows = _ints(args.rows)
    elif args.quick:
        rows = [100_000, 1_000_000]
    else:
        rows = [1_000_000, 10_000_000]
    if args.full and args.rows is None:
        rows.append(100_000_000)
    return {"shards": _ints(args.shards), "clients": _ints(args.clients), "rows": rows, "batch": _ints(args.batches)}


def _bytes_per_row_estimate(dim: int) -> int:
    return dim * 4 * 2 + _ROW_OVERHEAD_BYTES  # weights + Adagrad's per-coordinate accumulator + overhead


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        text = Path("/proc/meminfo").read_text()
        line = next(x for x in text.splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return None


# --- process CPU and memory -------------------------------------------------------------------------------
def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (``/proc/<pid>/stat`` utime + stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / _TICK


def _self_cpu_s() -> float:
    """User + system CPU seconds of every thread of this process (``getrusage``: microseconds, not ticks)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    return 0


# --- client processes -------------------------------------------------------------------------------------
def _die_with_parent() -> None:  # a crashed benchmark leaves no client processes behind
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main() -> int:
    """A client process: JSON requests on stdin, one JSON reply line each on stdout (nothing else goes there)."""
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the death signal was armed
        return 0
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    points: dict[str, dict] = {}
    try:
        for line in sys.stdin.buffer:
            msg = json.loads(line)
            try:
                reply = _worker_op(points, msg)
            except Exception as exc:  # reported to the coordinator, which raises it
                reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
    finally:
        for p in points.values():
            with contextlib.suppress(Exception):
                p["client"].close()
    return 0


def _worker_op(points: dict[str, dict], msg: dict) -> dict:
    op = msg["op"]
    if op == "prepare":
        client = ps.connect(msg["addresses"])
        client.wait_ready(60)
        _create_table(client, msg["dim"])
        batches = zipf_batches(msg["count"], msg["batch"], msg["num_ids"], msg["zipf"], seed=msg["seed"])
        rng = np.random.default_rng(msg["seed"] + 1)
        grads = [rng.normal(0, 0.01, (msg["batch"], msg["dim"])).astype(np.float32) for _ in range(2)]
        points[msg["key"]] = {"client": client, "batches": batches, "grads": grads, "i": 0}
        return {"unique_ids": float(np.mean([np.unique(b).size for b in batches]))}
    if op == "run":
        p = points[msg["key"]]
        client, batches, grads, kind = p["client"], p["batches"], p["grads"], msg["kind"]
        rows, cpu0 = 0, _self_cpu_s()
        for _ in range(msg["batches"]):
            p["i"] += 1
            b, g = batches[p["i"] % len(batches)], grads[p["i"] % len(grads)]
            if kind in ("pull", "step"):
                client.pull(TABLE, b)
            if kind in ("push", "step"):
                client.push(TABLE, b, g)
            rows += b.size
        if kind != "pull":
            client.flush()
        return {"rows": rows, "cpu_s": _self_cpu_s() - cpu0}
    if op == "release":
        p = points.pop(msg["key"], None)
        if p is not None:
            p["client"].close()
        return {}
    raise ValueError(f"unknown op {op!r}")


class _Worker:
    """One client process (``python -m tigana.tools.bench.scale --worker``) and its request/reply pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tigana.tools.bench.scale", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid

    def send(self, **msg) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = 900.0) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            code = self.proc.poll()
            raise RuntimeError(f"bench scale: client process {self.pid} "
                               + ("did not answer in time" if code is None else f"exited with code {code}"))
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench scale: client process {self.pid}: {reply['error']}\n{reply['traceback']}")
        return reply

    def call(self, **msg) -> dict:
        self.send(**msg)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the worker's loop ends at EOF and closes its clients
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# --- clusters ---------------------------------------------------------------------------------------------
def _create_table(client: ps.Client, dim: int) -> None:
    # Uniform, not the default Normal: the timed runs touch only pre-loaded rows, so the initializer only sets
    # how fast the pre-load inserts (Normal's per-row seeded draw is ~4x slower at dim 64).
    client.create_table(TABLE, dim=dim, optimizer=ps.Adagrad(lr=0.01), initializer=ps.Uniform(), staleness=1)


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


# --- one point of a curve ---------------------------------------------------------------------------------
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


# --- the run ----------------------------------------------------------------------------------------------
def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"tigana bench scale --plot needs matplotlib, the optional `plot` extra: {PLOT_EXTRA}"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker_main()
    plt = _require_matplotlib() if args.plot else None  # fail before minutes of measuring, not after
    curves = [c.strip() for c in args.curves.split(",") if c.strip()]
    unknown = sorted(set(curves) - set(CURVES))
    if unknown:
        raise SystemExit(f"bench scale: unknown curve(s) {unknown}; choose from {list(CURVES)}")
    sizes = _sizes(args)
    repeats = args.repeats or (3 if args.quick else 7)
    unit_rows = args.unit_rows or ((1 << 18) if args.quick else (1 << 20))
    base = {"dim": args.dim, "wire": "fp32", "optimizer": "adagrad", "zipf": args.zipf, "staleness": 1,
            "repeats": repeats, "quick": bool(args.quick), "full": bool(args.full)}
    if "rows" in curves:  # the biggest cluster must fit: refuse before starting anything
        biggest = max(sizes["rows"])
        need = biggest * _bytes_per_row_estimate(args.dim)
        avail = _mem_available()
        if avail is not None and need * 1.15 + (1 << 30) > avail:
            raise SystemExit(f"bench scale: {biggest:,} resident rows at dim {args.dim} need about "
                             f"{need / 1e9:.1f} GB of RAM; {avail / 1e9:.1f} GB available (lower --rows, or drop "
                             f"--full)")
    log(f"bench scale: curves {curves}, sizes { {c: sizes[c] for c in curves} }, dim {args.dim}, repeats {repeats}, "
        f"{unit_rows} ids per client per repeat")
    started = time.perf_counter()
    n_workers = max([1, *(sizes["clients"] if "clients" in curves else [])])
    clusters: dict[tuple[int, int], _Cluster] = {}
    workers: list[_Worker] = []
    lines: list[dict] = []
    keys = iter(range(1 << 30))
    try:
        workers = [_Worker() for _ in range(n_workers)]

        def cluster(shards: int, rows: int) -> _Cluster:
            if (shards, rows) not in clusters:
                clusters[(shards, rows)] = _Cluster(shards, rows, args.dim)
            return clusters[(shards, rows)]

        home = (args.base_shards, args.base_rows)
        for curve in curves:
            t0 = time.perf_counter()
            points = []
            for x in sizes[curve]:
                shards, rows = {"shards": (x, args.base_rows), "rows": (args.base_shards, x)}.get(curve, home)
                p = _Point(curve, x, cluster(shards, rows), workers[:x] if curve == "clients" else workers[:1],
                           x if curve == "batch" else args.batch, f"p{next(keys)}")
                p.prepare(args, unit_rows)
                points.append(p)
            _measure(points, repeats)
            lines += _emit_curve(points, base)
            for p in points:
                p.release()
            for key in [k for k in clusters if k != home]:  # keep the shared 2-shard cluster for later curves
                clusters.pop(key).close()
            log(f"bench scale: curve {curve} in {time.perf_counter() - t0:.0f}s")
    finally:
        for w in workers:
            w.close()
        for c in clusters.values():
            c.close()
    log(f"bench scale: done in {time.perf_counter() - started:.0f}s")
    if plt is not None:
        plot(lines, args.plot, plt)
        log(f"bench scale: wrote {args.plot}")
    return 0


# --- the figure -------------------------------------------------------------------------------------------
def plot(lines: list[dict], path: str | os.PathLike, plt=None) -> None:
    """A 2x2 figure (shards, clients, resident rows, batch): rows/s (solid, left axis) and CPU-s per M rows
    (dashed, right axis) of pull, push and step against the curve's variable."""
    plt = plt or _require_matplotlib()
    titles = {"shards": ("shard daemons", "shards"), "clients": ("client processes", "clients"),
              "rows": ("resident rows", "rows"), "batch": ("ids per batch", "batch")}
    colors = {"pull": "tab:blue", "push": "tab:orange", "step": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.2))
    for ax, curve in zip(axes.ravel(), CURVES, strict=True):
        title, key = titles[curve]
        mine = [d for d in lines if d.get("curve") == curve and d["case"] != "scale.rows.memory"]
        if not mine:
            ax.set_axis_off()
            ax.set_title(f"{title}: not run")
            continue
        cpu_ax = ax.twinx()
        for kind in KINDS:
            for unit, axis, style in (("rows/s", ax, "-o"), ("cpu_s/M rows", cpu_ax, "--s")):
                pts = sorted((d[key], d["value"]) for d in mine if d["case"].endswith("." + kind) and d["unit"] == unit)
                xs, ys = zip(*pts, strict=True)
                axis.plot(xs, [y / 1e6 if unit == "rows/s" else y for y in ys], style, color=colors[kind],
                          label=f"{kind} {'M rows/s' if unit == 'rows/s' else 'CPU-s/M rows'}", markersize=4)
        ax.set_xscale("log", base=2 if curve in ("shards", "clients", "batch") else 10)
        xs = sorted({d[key] for d in mine})
        ax.set_xticks(xs)
        ax.set_xticklabels([_short(x, binary=curve == "batch") for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(title)
        ax.set_ylabel("M rows/s (solid)")
        cpu_ax.set_ylabel("CPU-s per M rows (dashed)")
        ax.set_ylim(bottom=0)
        cpu_ax.set_ylim(bottom=0)
        ax.set_title(f"against {title}")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[k], label=k) for k in KINDS] + [
        plt.Line2D([], [], color="gray", linestyle="-", marker="o", label="rows/s"),
        plt.Line2D([], [], color="gray", linestyle="--", marker="s", label="CPU-s per M rows (client + servers)")]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False)
    first = next(iter(lines), {})
    fig.suptitle(f"tigana bench scale: dim {first.get('dim', '?')} fp32, Adagrad, Zipf({first.get('zipf', '?')}) "
                 "ids, CPU of client and server processes")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _short(x: int, binary: bool = False) -> str:
    """4096 -> "4k" (binary), 1000000 -> "1M"."""
    base = 1024 if binary else 1000
    for power, suffix in ((3, "B"), (2, "M"), (1, "k")):
        if x >= base ** power and x % base ** power == 0:
            return f"{x // base ** power}{suffix}"
    return f"{x:,}"


if __name__ == "__main__":  # a client process: python -m tigana.tools.bench.scale --worker
    _parser = argparse.ArgumentParser()
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
