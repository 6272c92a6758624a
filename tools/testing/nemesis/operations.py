"""The nemesis's planned operations, run as an operator runs them: ``tigana admin ...`` as a subprocess (its
own process group, killed when it overruns), and tables created and dropped through ``ps.connect``.

- ``scratch_create`` / ``scratch_drop``: a scratch table (sync or async, by the seed) written by a client of its
  own from its creation to its drop; the drop comes while that client still pushes (replication in flight).
- ``move`` / ``move_primary``: ``admin move-slot S --to X`` (``--primary``) to a server that holds no copy of S;
  ``handover``: ``admin move-slot S --to X --primary`` to a server that already holds a copy of S.
- ``rebalance``, ``drain`` (``admin drain X``, then ``--undrain``), ``join`` (a new ``tigana server
  --scheduler ...``, then ``admin rebalance``), ``checkpoint`` (every table), ``export`` (a ledger table; every
  exported row must be whole: all its elements equal).
- ``restore``: a table of known contents is checkpointed (``admin checkpoint --table``), half its rows written
  again and checkpointed incrementally on it (``--incremental --quantize int8``), all written once more, the
  chain restored (``admin restore --table``) and pulled: it must hold exactly what the second cut held. The ledger
  tables are never restored, so they stay auditable.

Every operation returns an ``OpResult``; one that fails (non-zero exit, timeout, wrong contents) is counted,
and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tigana import ps
from tigana.ps.ops import admin
from tigana.ps.routing import IN_SYNC
from tigana.tools.bench.ledger import TABLE_DIM, PushLoop, create_ledger_table
from tigana.tools.testing.nemesis.daemons import Daemons, tigana_command
from tigana.tools.testing.nemesis.workload import DURABILITIES, Ledgers


@dataclass
class OpResult:
    op: str
    ok: bool
    seconds: float
    detail: str = ""
    skipped: bool = False
    started_at: float = 0.0  # monotonic

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "ok": self.ok, "s": round(self.seconds, 2), "detail": self.detail[:300],
                **({"skipped": True} if self.skipped else {})}


def admin_cli(scheduler: str, args: list[str], timeout_s: float, env: dict[str, str] | None = None
              ) -> tuple[int, dict[str, Any] | None, str]:
    """``tigana admin --scheduler S --json --timeout T ARGS``: (exit code, its JSON report, stderr's tail).
    The process is killed (its group) when it runs ``timeout_s`` + 30 s."""
    argv = [*tigana_command(), "admin", "--scheduler", scheduler, "--json", "--timeout", f"{timeout_s:g}", *args]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout_s + 30:.0f}s)"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = None
    lines = [line for line in out.splitlines() if line.strip()]
    if lines:
        with contextlib.suppress(ValueError):
            report = json.loads(lines[-1])
    return proc.returncode, report, err.strip()[-400:]


class Operations:
    """The planned operations of one run (``run(op)``), on ``daemons``' cluster; ``ctl`` is the bench's own
    client (tables, checks). ``timeout_s`` bounds each admin command's wait for its moves."""

    def __init__(self, daemons: Daemons, ledgers: Ledgers, ctl: ps.Client, rng: random.Random, run_dir: Path,
                 *, timeout_s: float, max_joins: int) -> None:
        self.d, self.ledgers, self.ctl, self.rng = daemons, ledgers, ctl, rng
        self.run_dir, self.timeout_s, self.joins_left = run_dir, timeout_s, max_joins
        self.scheduler = daemons.scheduler_address
        self.count = 0
        self.scratch: tuple[str, ps.Client, PushLoop] | None = None

    def run(self, op: str) -> OpResult:
        self.count += 1
        t = time.monotonic()
        try:
            ok, detail, skipped = getattr(self, f"_{op}")()
        except Exception as exc:  # noqa: BLE001 - an operation that raised failed; the run goes on
            ok, detail, skipped = False, f"{type(exc).__name__}: {exc}", False
        return OpResult(op, ok, time.monotonic() - t, detail, skipped, t)

    # --- helpers ----------------------------------------------------------------------------------------
    def _admin(self, *args: str) -> tuple[bool, str]:
        rc, report, err = admin_cli(self.scheduler, list(args), self.timeout_s, self.d.env)
        what = " ".join(args)
        if rc == 0:
            return True, what
        reason = (report or {}).get("error") or err.splitlines()[-1:] or [""]
        return False, f"{what}: exit {rc}: {reason if isinstance(reason, str) else reason[0]}"

    def _up_servers(self) -> tuple[Any, list[int]]:
        m = admin.shard_map(self.scheduler)
        draining = set(admin.status(self.scheduler).draining)
        up = [i for i, s in enumerate(m.servers) if s.up and s.id not in draining and s.address not in draining]
        return m, up

    def _move_to(self, primary: bool, holder: bool) -> tuple[bool, str, bool]:
        m, up = self._up_servers()
        for _ in range(200):
            slot = self.rng.randrange(m.num_slots)
            copies = m.copies[slot]
            if copies[0] < 0:
                continue
            if holder:  # a server already holding an in-sync copy (not the primary)
                cands = [int(c) for c, st in zip(copies[1:], m.states[slot][1:], strict=True)
                         if c >= 0 and st == IN_SYNC and int(c) in up]
            else:
                cands = [i for i in up if i not in set(copies.tolist())]
            if cands:
                to = m.servers[self.rng.choice(cands)].address
                ok, detail = self._admin("move-slot", str(slot), "--to", to, *(["--primary"] if primary else []))
                return ok, detail, False
        return True, "no slot with such a target", True

    # --- the operations ---------------------------------------------------------------------------------
    def _move(self) -> tuple[bool, str, bool]:
        return self._move_to(primary=False, holder=False)

    def _move_primary(self) -> tuple[bool, str, bool]:
        return self._move_to(primary=True, holder=False)

    def _handover(self) -> tuple[bool, str, bool]:
        return self._move_to(primary=True, holder=True)

    def _rebalance(self) -> tuple[bool, str, bool]:
        return (*self._admin("rebalance"), False)

    def _drain(self) -> tuple[bool, str, bool]:
        m, up = self._up_servers()
        if len(up) < m.replicas + 2:
            return True, f"{len(up)} server(s) up: none can be drained", True
        address = m.servers[self.rng.choice(up)].address
        ok, detail = self._admin("drain", address)
        ok2, detail2 = self._admin("drain", address, "--undrain")
        return ok and ok2, f"{detail}; {detail2}", False

    def _join(self) -> tuple[bool, str, bool]:
        if self.joins_left <= 0:
            return True, "no joins left", True
        self.joins_left -= 1
        server = self.d.start_server()
        server.wait_ready(120)
        ok, detail = self._admin("rebalance")
        return ok, f"{server.name} joined at {server.address}; {detail}", False

    def _checkpoint(self) -> tuple[bool, str, bool]:
        return (*self._admin("checkpoint", "--dir", str(self.run_dir / f"checkpoint-{self.count}")), False)

    def _export(self) -> tuple[bool, str, bool]:
        table = self.ledgers.table(self.rng.choice(DURABILITIES))
        out = self.run_dir / f"export-{self.count}"
        ok, detail = self._admin("export", table, "--out", str(out))
        if not ok:
            return False, detail, False
        rows = np.load(out / "rows.npy")
        torn = int((rows != rows[:, :1]).any(axis=1).sum()) if rows.size else 0
        return torn == 0, f"{detail}: {rows.shape[0]} rows, {torn} torn", False

    def _scratch_create(self) -> tuple[bool, str, bool]:
        durability = self.rng.choice(DURABILITIES)
        name = f"scratch-{self.count}-{durability}"
        create_ledger_table(self.ctl, name, durability=durability)
        # its pushes fail once the table is dropped: a short failover timeout stops its client quickly
        client = ps.connect(scheduler=self.scheduler, failover_timeout_s=3.0)
        loop = PushLoop(client, table=name, num_ids=5000, ids_per_push=200, in_flight=2, pause_s=0.01,
                        seed=self.count).start()
        self.scratch = (name, client, loop)
        rows = self.ctl.pull(name, np.arange(100, dtype=np.int64))
        return rows.shape == (100, TABLE_DIM), f"created {name}", False

    def _scratch_drop(self) -> tuple[bool, str, bool]:
        if self.scratch is None:
            return True, "no scratch table", True
        name, client, loop = self.scratch
        self.scratch = None
        acked = loop.acked_count()
        t = time.monotonic()
        try:
            dropped = self.ctl.drop_table(name)  # while its client still pushes
        finally:
            drop_s = time.monotonic() - t
            self.close_scratch(loop, client)
        return dropped and acked > 0, f"dropped {name} after {acked} pushes (the drop took {drop_s:.1f}s)", False

    def close_scratch(self, loop: PushLoop | None = None, client: ps.Client | None = None) -> None:
        """Stop the scratch table's client (the one given, or the live one); never raises."""
        if loop is None and self.scratch is not None:
            _, client, loop = self.scratch
            self.scratch = None
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.stop(15)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _restore(self) -> tuple[bool, str, bool]:
        name = f"restore-{self.count}"
        ids = np.arange(1000, dtype=np.int64)
        grads = -np.ones((ids.size, TABLE_DIM), np.float32)
        create_ledger_table(self.ctl, name, durability="sync")
        # a client of its own: a push error is stored by the client that pushed, and must not reach the audit
        client = ps.connect(scheduler=self.scheduler)
        try:
            for _ in range(3):
                client.push(name, ids, grads).result()
            chain = self.run_dir / f"restore-{self.count}"
            ok, detail = self._admin("checkpoint", "--dir", str(chain / "full"), "--table", name)
            if ok:  # an incremental one on it (int8: the rows are constant, so exact) holds the half pushed since
                for _ in range(2):
                    client.push(name, ids[::2], grads[::2]).result()
                ok, detail2 = self._admin("checkpoint", "--dir", str(chain / "incremental"), "--table", name,
                                          "--incremental", "--quantize", "int8")
                detail = f"{detail}; {detail2}"
            if ok:
                client.push(name, ids, grads).result()  # after the cut: the restore must undo it
                ok, detail2 = self._admin("restore", str(chain / "incremental"), "--table", name)
                detail = f"{detail}; {detail2}"
            wrong = -1
            if ok:
                rows = client.pull(name, ids, insert=False)
                want = np.where(ids % 2 == 0, 5.0, 3.0).astype(np.float32)[:, None]
                wrong = int((rows != want).any(axis=1).sum())
                detail += f"; {wrong} of {ids.size} rows differ from the checkpoints"
        finally:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                self.ctl.drop_table(name)
        return ok and wrong == 0, detail, False
