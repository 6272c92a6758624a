"""A standalone ``tigana server`` started as a user starts it (a data dir) and ``kill -9``-ed loses at most the
updates acknowledged since its last periodic snapshot.

Regression (issue 16): ``--snapshot-every`` defaulted to 0, so such a server lost every acknowledged update
since it started (100,000 of 100,000). The default is now a snapshot every 60 s (``ServerConfig``; what the
CLI resolves with no flag is checked below). The test runs the same periodic snapshots at a 3 s interval, so
that it does not wait a minute; ``tigana bench durability --only standalone`` runs the default interval with
no flag at all and reports what it lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest

from tigana import ps
from tigana.embeddings import snapshot as snap
from tigana.ps.ops import admin
from tigana.tools.bench.durability import CLI, standalone_server
from tigana.tools.bench.ledger import PushLoop, create_ledger_table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_snapshots_are_on_by_default_for_a_server_started_with_no_flag(tmp_path) -> None:
    """What ``tigana server --data-dir D`` runs with, as the CLI resolves it (no flag, no TIGANA_* variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIGANA_")}
    out = subprocess.run([*CLI, "config", "show", "server", "--json", "--data-dir", str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert json.loads(out)["config"]["snapshot_every"] == ps.ServerConfig().snapshot_every_s == 60.0


def test_kill_9_of_a_standalone_server_loses_at_most_the_last_snapshot_interval(tmp_path) -> None:
    data, log = tmp_path / "s0", tmp_path / "server.log"
    snapshots = data / "snapshots" / "ledger"
    every = 3.0
    with standalone_server(data, "--snapshot-every", str(every), log=log) as (proc, address), \
            ps.connect([address]) as client:
        create_ledger_table(client)
        before = PushLoop(client, num_ids=20_000, ids_per_push=500, seed=1).start()
        admin.wait_for(lambda: before.acked_count() >= 100, timeout_s=60, what="pushes before the snapshot")
        before.stop()
        taken = len(snap.list_snapshots(snapshots))
        # every update so far is acknowledged; the next periodic snapshot (at most one interval away) has them
        admin.wait_for(lambda: len(snap.list_snapshots(snapshots)) > taken, timeout_s=every + 60,
                       what=f"a periodic snapshot (every {every:g} s)")
        after = PushLoop(client, num_ids=20_000, ids_per_push=500, seed=2).start()
        admin.wait_for(lambda: after.acked_count() >= 100, timeout_s=60, what="pushes after the snapshot")
        after.stop()
        os.kill(proc.pid, signal.SIGKILL)  # no drain, no snapshot on the way out
        proc.wait(30)
    with standalone_server(data, log=log) as (_, address), ps.connect([address]) as client:
        actual = np.rint(client.pull("ledger", np.arange(20_000), insert=False)[:, 0]).astype(np.int64)
    assert not before.errors and not after.errors, (before.errors[:3], after.errors[:3])
    acked = before.acked + after.acked
    lost = int(np.maximum(acked - actual, 0).sum())
    doubled = int(np.maximum(actual - acked, 0).sum())
    print(f"standalone kill -9, snapshots every {every:g} s: acked {int(acked.sum())} updates ({int(before.acked.sum())} "
          f"before the last snapshot, {int(after.acked.sum())} after it), lost {lost}, doubled {doubled}")
    assert doubled == 0
    assert (actual >= before.acked).all(), "an update acknowledged before the last snapshot was lost"
    assert lost <= int(after.acked.sum())  # at most what was acknowledged since the last snapshot
