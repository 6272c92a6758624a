"""Storage faults: ``kill -9`` in the middle of a snapshot write, a full disk (a small tmpfs: root), a full
LMDB map in the spill tier, and corrupted snapshot files (truncated, bytes flipped) on a clustered server."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import random
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tigana import ps
from tigana.embeddings import snapshot as snap
from tigana.ps.ops import admin
from tigana.tools.bench.ledger import audit
from tigana.tools.bench.report import log
from tigana.tools.testing.faults.common import (
    Report,
    cluster,
    ledger_cluster,
    pct,
    percentiles,
    ready_for_fault,
    wait_settled,
)

DIM = 16


def _digest(client: ps.Client, table: str, ids: np.ndarray) -> str:
    """A hash of the rows of ``ids`` (read only)."""
    h = hashlib.blake2b(digest_size=16)
    for lo in range(0, ids.size, 65536):
        h.update(client.pull(table, ids[lo:lo + 65536], insert=False).tobytes())
    return h.hexdigest()


def _push_all(client: ps.Client, table: str, ids: np.ndarray) -> None:
    grads = -np.ones((65536, DIM), np.float32)
    futures = [client.push(table, ids[lo:lo + 65536], grads[: ids[lo:lo + 65536].size])
               for lo in range(0, ids.size, 65536)]
    for f in futures:
        f.result()


def _temp_dirs(data_dir: Path) -> list[Path]:
    return list(data_dir.glob("snapshots/*/.tmp-*"))


# --- kill -9 during a snapshot write ------------------------------------------------------------------------
def snapshot_kill(trials: int, quick: bool, **_: Any) -> Report:
    """A standalone daemon holds a table; each trial snapshots it (state A), changes every row (state B),
    starts another snapshot (full or incremental, alternating) and ``kill -9``-s the daemon while the new
    snapshot is being written (its temp dir exists). Restarted, the daemon must hold exactly A (the partial
    snapshot refused) or, had the write finished, exactly B; anything else is a partial restore."""
    rows = 100_000 if quick else 300_000
    ids = np.arange(rows, dtype=np.int64)
    previous = new = partial = crashes = mid_write = 0
    with cluster(1, replicas=None) as c:
        data_dir = c.data_dir / "shard-0"
        for trial in range(trials):
            incremental = trial % 2 == 1
            with ps.connect(c.target, failover_timeout_s=30, max_attempts=1) as client:
                if trial == 0:
                    client.create_table("snap", dim=DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
                _push_all(client, "snap", ids)
                t = time.monotonic()
                client.snapshot()
                took = time.monotonic() - t
                state_a = _digest(client, "snap", ids)
                _push_all(client, "snap", ids)
                state_b = _digest(client, "snap", ids)
                writer = threading.Thread(target=_snapshot_quietly, args=(client, incremental), daemon=True)
                writer.start()
                deadline = time.monotonic() + 30
                while not _temp_dirs(data_dir) and time.monotonic() < deadline:
                    time.sleep(0.001)
                # The first trial kills as soon as the write's temp dir appears (so at least one kill lands mid-write
                # however fast this write is: an incremental one can finish well within the full one's time);
                # the others at a random point of the time the last full snapshot took.
                time.sleep(0.0 if trial == 0 else random.uniform(0.0, 0.8 * took))
                c.kill(0)
                mid_write += bool(_temp_dirs(data_dir))
                writer.join(30)
            try:
                c.restart(0)
            except Exception as exc:  # noqa: BLE001 - a daemon that cannot start is what this counts
                crashes += 1
                log(f"  snapshot-kill trial {trial + 1}: restart failed: {exc}")
                break
            with ps.connect(c.target, failover_timeout_s=30) as client:
                got = _digest(client, "snap", ids)
            previous += got == state_a
            new += got == state_b
            partial += got not in (state_a, state_b)
            log(f"  snapshot-kill trial {trial + 1}/{trials}: {'incremental' if incremental else 'full'} write "
                f"killed after its temp dir appeared; restored {'A' if got == state_a else 'B' if got == state_b else '??'}")
    f = {"trials": trials, "restored_previous": previous, "restored_new": new, "partial_restored": partial,
         "crashes": crashes, "kills_mid_write": mid_write, "rows": rows, "detected_pct": pct(previous + new, trials)}
    ok = partial == 0 and crashes == 0 and previous + new == trials and mid_write > 0
    return Report("restores", partial, "target", 0, ok, f)


def _snapshot_quietly(client: ps.Client, incremental: bool) -> None:
    with contextlib.suppress(ps.PSError):
        client.snapshot(incremental=incremental)


# --- a full disk, a full LMDB map -----------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(size_mib: int) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="tigana-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def _fill(where: Path) -> Path:
    """Write a filler file until the disk is full; returns it (delete it to free the space)."""
    filler = where / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    with contextlib.suppress(OSError), open(filler, "ab") as f:  # the last partial block
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return filler


class _Trial:
    """Counts of one storage-full trial: refusals expected and clean, state changes, crashes, resumptions."""

    def __init__(self) -> None:
        self.expected = self.clean = self.changed = self.crashes = self.resumed = self.corrupted = 0

    def refuse(self, fn, before: str, after) -> None:
        """``fn()`` must raise ``ResourceExhausted``; ``after()`` must still equal ``before``."""
        self.expected += 1
        try:
            fn()
        except ps.ResourceExhausted:
            self.clean += 1
        except ps.PSError as exc:
            log(f"    expected RESOURCE_EXHAUSTED, got {type(exc).__name__}: {exc}")
        self.changed += after() != before

    def figures(self, trials: int) -> dict[str, Any]:
        return {"trials": trials, "rejected_pct": pct(self.clean, self.expected), "state_changes": self.changed,
                "crashes": self.crashes, "corrupted": self.corrupted, "resumed_pct": pct(self.resumed, trials)}

    def ok(self, trials: int) -> bool:
        return (self.clean == self.expected and not self.changed and not self.crashes and not self.corrupted
                and self.resumed == trials)


def _insert_until_refused(client: ps.Client, table: str, start: int, batch: int = 20_000, limit: int = 400) -> int:
    """Pull (insert) new ids batch after batch until one is refused; returns the first id not stored."""
    for k in range(limit):
        lo = start + k * batch
        try:
            client.pull(table, np.arange(lo, lo + batch))
        except ps.ResourceExhausted:
            return lo
    raise AssertionError(f"table {table!r}: {limit} batches of new rows were all accepted")


# The disk_full trial's disk: once freed, it must hold what the full disk let the table store, which is what
# the spill file had reserved before the disk filled (it grows by posix_fallocate, 64 MiB at a time: records
# fit there while the disk is full), and then the same again: the spill file's next growth (the inserts that
# resume), and two full snapshots side by side (~75 MiB each for those rows: the new one is written before
# the old one is deleted). 96 MiB held only the reserved spill room and left 32 MiB for a 75 MiB snapshot.
DISK_FULL_MIB = 384


def disk_full(trials: int, quick: bool, **_: Any) -> Report:
    """A standalone daemon with a memory budget keeps its data dir (snapshots, spill tier) on a tmpfs of
    ``DISK_FULL_MIB``. Each trial fills the disk, then: a snapshot and inserts past what the spill file can
    hold must answer RESOURCE_EXHAUSTED and change nothing, and the daemon must live; freed, both resume;
    restarted from the snapshot written then, it holds what it held."""
    t = _Trial()
    with _tmpfs(DISK_FULL_MIB) as where, cluster(1, replicas=None, data_dir=where, memory_budget="4MiB") as c:
        data_dir = c.data_dir / "shard-0"
        for trial in range(trials):
            table = f"full{trial}"
            with ps.connect(c.target, failover_timeout_s=30, max_attempts=1) as client:
                client.create_table(table, dim=DIM, optimizer=ps.Adagrad(lr=0.1), initializer=ps.Zeros())
                held = np.arange(50_000)
                client.pull(table, held)
                client.push(table, held, np.ones((held.size, DIM), np.float32)).result()
                filler = _fill(data_dir)
                before = _digest(client, table, held)
                now = functools.partial(_digest, client, table, held)
                t.refuse(client.snapshot, before, now)
                # The spill file already took its first growth step (the held rows pass the budget), so inserts
                # fill that room and are refused when the file cannot grow: the table then holds ~64 MiB.
                end = _insert_until_refused(client, table, 1 << 40)
                t.refuse(functools.partial(client.pull, table, np.arange(end, end + 20_000)), before, now)
                alive = c.alive()[0]
                t.crashes += not alive
                filler.unlink()
                try:
                    client.snapshot()
                    client.pull(table, np.arange(2 << 40, (2 << 40) + 20_000))  # inserts resume
                    t.resumed += 1
                except ps.PSError as exc:
                    log(f"  disk-full trial {trial + 1}: did not resume: {exc}")
                expect = _digest(client, table, held)
                client.snapshot()
            c.kill(0)
            c.restart(0)
            with ps.connect(c.target, failover_timeout_s=30) as client:
                t.corrupted += _digest(client, table, held) != expect
                client.drop_table(table)
            log(f"  disk-full trial {trial + 1}/{trials}: {t.figures(trial + 1)}")
    f = t.figures(trials) | {"tmpfs_mib": DISK_FULL_MIB, "memory_budget": "4MiB"}
    return Report("pct", f["rejected_pct"], "target", 100.0, t.ok(trials), f)


def lmdb_map_full(trials: int, quick: bool, **_: Any) -> Report:
    """A standalone daemon with a 4 MiB memory budget and its spill tier capped at 1 MiB: inserting rows
    until the spill file is at its cap (the case's name is from when the tier was an LMDB map) must end in RESOURCE_EXHAUSTED that changes nothing while stored rows still
    update; restarted with a larger cap (the space freed), the rows are intact and inserts resume."""
    t = _Trial()
    with tempfile.TemporaryDirectory(prefix="tigana-mapfull-") as tmp:
        for trial in range(trials):
            table = "spilled"
            data_dir = Path(tmp) / f"t{trial}"
            with cluster(1, replicas=None, data_dir=data_dir, memory_budget="4MiB",
                         server_args=["--spill-max-bytes", "1MiB"]) as c, \
                    ps.connect(c.target, failover_timeout_s=30, max_attempts=1) as client:
                client.create_table(table, dim=DIM, optimizer=ps.Adagrad(lr=0.1), initializer=ps.Zeros())
                end = _insert_until_refused(client, table, 0)
                held = np.arange(end)
                now = functools.partial(_digest, client, table, held)
                t.refuse(functools.partial(client.pull, table, np.arange(end, end + 20_000)), now(), now)
                client.push(table, held[:1000], np.ones((1000, DIM), np.float32)).result()  # updates go on
                expect = now()
                t.crashes += not c.alive()[0]
            # the operator frees space: a restart with a larger cap (rows come back from the shutdown snapshot)
            with cluster(1, replicas=None, data_dir=data_dir, memory_budget="4MiB",
                         server_args=["--spill-max-bytes", "64MiB"]) as c, \
                    ps.connect(c.target, failover_timeout_s=30) as client:
                t.corrupted += _digest(client, table, held) != expect
                try:
                    client.pull(table, np.arange(end, end + 20_000))
                    t.resumed += 1
                except ps.PSError as exc:
                    log(f"  map-full trial {trial + 1}: did not resume: {exc}")
            log(f"  map-full trial {trial + 1}/{trials}: {end} rows stored before the spill file was full")
    f = t.figures(trials) | {"memory_budget": "4MiB", "spill_max_bytes": "1MiB"}
    return Report("pct", f["rejected_pct"], "target", 100.0, t.ok(trials), f)


# --- corrupted store ------------------------------------------------------------------------------------------
def _store_files(data_dir: Path) -> list[Path]:
    """The files a restarting server reads: the table registry and every file of each table's newest chain."""
    files = [data_dir / "tables.json"]
    for root in (data_dir / "snapshots").iterdir():
        chain = snap.list_snapshots(root)
        fulls = [i for i, p in enumerate(chain) if p.name.endswith("-full")]
        for d in chain[fulls[-1] if fulls else 0:]:
            files += [p for p in d.rglob("*") if p.is_file() and p.name != "lock.mdb"]
    return [p for p in files if p.exists()]


def corrupt(path: Path, rng: random.Random) -> str:
    """Truncate ``path`` or flip one byte of it, at random; says which."""
    size = path.stat().st_size
    if rng.random() < 0.5 or size == 0:
        cut = rng.randrange(0, max(size, 1))
        os.truncate(path, cut)
        return f"truncated {path.name} {size} -> {cut} bytes"
    at = rng.randrange(size)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return f"flipped a bit of byte {at} of {path.name}"


def corrupt_store(trials: int, quick: bool, **_: Any) -> Report:
    """Two clustered daemons under a ledger push loop. Each trial snapshots both, ``kill -9``-s one, damages
    one file of its store (truncated or one bit flipped), restarts it: the daemon must detect it (count it,
    quarantine the file, start that table empty) and be rebuilt from its replica; no update is lost."""
    rng = random.Random(7)
    detected = 0
    resync: list[float] = []
    with ledger_cluster(2) as (c, client, loop):
        for trial in range(trials):
            ready_for_fault(c, loop)
            client.snapshot()
            victim = trial % 2
            c.kill(victim)
            data_dir = c.data_dir / f"shard-{victim}"
            target = rng.choice(_store_files(data_dir))
            what = corrupt(target, rng)
            before = _quarantined(c, victim)
            t = time.monotonic()
            c.restart(victim)  # ready once it serves: the damage was found while it loaded, or never
            seen = _quarantined(c, victim) > before
            wait_settled(c)
            resync.append(time.monotonic() - t)
            detected += seen
            log(f"  corrupt trial {trial + 1}/{trials}: {what}: detected {seen}, rebuilt in {resync[-1]:.2f}s")
        ready_for_fault(c, loop)  # and pushes after the last trial
        loop.stop()
        result = audit(client, loop)
        check = admin.verify(c.scheduler)
    f = {"detected_pct": pct(detected, trials), "trials": trials, "lost": result.lost, "doubled": result.doubled,
         "copies_differing": len(check["differing"]),
         **{k.replace("recovery", "resync"): v for k, v in percentiles(resync).items()}}
    ok = detected == trials and result.lost == 0 and result.doubled == 0 and not check["differing"]
    return Report("pct", f["detected_pct"], "target", 100.0, ok, f)


def _quarantined(c: ps.LocalCluster, i: int) -> int:
    """How many stores shard i has found corrupt and quarantined, over all its runs (its log says so)."""
    path = c.log_path(i)
    return path.read_text(errors="replace").count("to be rebuilt from replicas") if path.exists() else 0
