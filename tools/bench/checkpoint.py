"""``tigana bench checkpoint [--quick]``: bytes and seconds of full, incremental and quantized checkpoints over
training intervals, and the model's AUC after restoring each.

A scheduler and 2 shard daemons (``ps.LocalCluster``, one backup a slot) hold two tables:

- ``bulk``: ``--rows`` rows (default 10 M; quick 200 k) of dim 16, row-wise Adagrad; each interval pushes a
  gradient to ``--changed`` of them (default 1 %), drawn afresh;
- ``model``: the fused table of a DeepFM trained in this process on synthetic Criteo-format data through the
  PS (Adagrad rows, Adam dense layers), ``--steps`` batches of 1,024 an interval.

After each of ``--intervals`` intervals (default 10) the cluster is checkpointed four ways, each into its own
chain (``Client.checkpoint``, what ``tigana admin checkpoint`` runs):

==================  ========================================================================================
``full``            every row, float32 (the peer)
``incremental``     ``--incremental``: the first checkpoint full, then the rows changed since the one before
``int8``            ``--quantize int8``: every row, weights int8 (optimizer state exact)
``incremental_int8`` both
==================  ========================================================================================

One JSON line per mode and figure (``tigana.tools.bench.report.emit``), the peer the full checkpoints:

- ``checkpoint.bytes``: bytes written over all the intervals (target for ``incremental_int8``: <= 0.1x);
- ``checkpoint.seconds``: seconds of the checkpoint calls over all the intervals;
- ``checkpoint.restore_seconds``: seconds to restore the last checkpoint of the mode (its chain for an
  incremental one) onto the cluster, every table;
- ``checkpoint.auc``: the model's AUC on held-out rows after that restore, against after the full one's
  (``auc_delta``; target |delta| <= 0.001). A full restore continues bit-identically to the cut
  (``tests/ps/test_checkpoint_cut.py``), so the peer is the model as it was at the cut.

Superseded full checkpoints are deleted as the run goes (disk); the chains are kept until the end. Every
process the run starts is stopped by its own handle, also on failure.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from tigana import ps
from tigana.tools.bench.report import emit, log
from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.embedding import PSEmbeddingBags
from tigana.trainer.loop import evaluate
from tigana.trainer.models import build_model

DIM = 16
BATCH = 1024
CHUNK = 1 << 18  # ids a push of the bulk table carries
EVAL_START = 50_000_000  # held-out synthetic rows start here (training reads from 0)
MODES = {"full": {}, "incremental": {"incremental": True}, "int8": {"quantize": "int8"},
         "incremental_int8": {"incremental": True, "quantize": "int8"}}
TARGET_BYTES_RATIO = 0.1
TARGET_AUC_DELTA = 0.001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="200 k bulk rows, 3 training steps an interval (~1 min)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the bulk table (default 10,000,000)")
    parser.add_argument("--changed", type=float, default=0.01, help="fraction of bulk rows pushed an interval")
    parser.add_argument("--intervals", type=int, default=10, help="training intervals, a checkpoint after each")
    parser.add_argument("--steps", type=int, default=None, help="model training batches an interval (default 20)")
    parser.add_argument("--eval-rows", type=int, default=None, help="held-out rows scored (default 100,000)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    rows = args.rows or (200_000 if quick else 10_000_000)
    steps = args.steps or (3 if quick else 20)
    eval_rows = args.eval_rows or (20_000 if quick else 100_000)
    params: dict[str, Any] = dict(bulk_rows=rows, changed=args.changed, intervals=args.intervals, dim=DIM,
                                  bulk_optimizer="rowwise_adagrad", model="deepfm", dataset="synthetic",
                                  steps_per_interval=steps, batch_size=BATCH, eval_rows=eval_rows, shards=2,
                                  replicas=1, quick=quick)
    work = Path(tempfile.mkdtemp(prefix="tigana-bench-checkpoint-", dir=args.dir))
    try:
        with ps.LocalCluster(2, data_dir=work / "cluster") as cluster, ps.connect(cluster.target) as client:
            _measure(client, work, rows=rows, steps=steps, eval_rows=eval_rows, changed=args.changed,
                     intervals=args.intervals, params=params)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


class _Model:
    """DeepFM over the PS's ``model`` table, trained on synthetic rows in order."""

    def __init__(self, client: ps.Client) -> None:
        self.data = SyntheticCriteo(seed=0)
        self.collection = PSEmbeddingBags(client, self.data.feature_specs(), DIM, fused_table="model")
        torch.manual_seed(0)
        self.model = build_model("deepfm", self.collection, self.data.config.num_dense)
        self.opt = torch.optim.Adam(self.model.dense_parameters(), lr=1e-3)
        self.next_row = 0

    def train(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            batch = self.data.batch(self.next_row, self.next_row + BATCH)
            self.next_row += BATCH
            loss = F.binary_cross_entropy_with_logits(self.model(batch.dense, batch.sparse), batch.labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        self.collection.flush()  # every gradient applied before the checkpoint

    def auc(self, eval_rows: int) -> float:
        batches = (self.data.batch(s, min(s + 8192, EVAL_START + eval_rows))
                   for s in range(EVAL_START, EVAL_START + eval_rows, 8192))
        return float(evaluate(self.model, batches)["auc"])


def _push_bulk(client: ps.Client, ids: np.ndarray, rng: np.random.Generator) -> None:
    futures = [client.push("bulk", ids[i:i + CHUNK], rng.normal(0, 0.1, (len(ids[i:i + CHUNK]), DIM))
                           .astype(np.float32)) for i in range(0, len(ids), CHUNK)]
    for f in futures:
        f.result()


def _measure(client: ps.Client, work: Path, *, rows: int, steps: int, eval_rows: int, changed: float,
             intervals: int, params: dict[str, Any]) -> None:
    client.create_table("bulk", dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.05), initializer=ps.Normal(std=0.01))
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(rows, dtype=np.int64) * 2654435761 + 17)  # spread over the id space
    log(f"bench checkpoint: {rows} bulk rows")
    _push_bulk(client, ids, rng)
    model = _Model(client)
    bytes_: dict[str, int] = dict.fromkeys(MODES, 0)
    seconds: dict[str, float] = dict.fromkeys(MODES, 0.0)
    last: dict[str, Path] = {}
    per_interval = max(1, int(rows * changed))
    for k in range(intervals):
        log(f"bench checkpoint: interval {k + 1}/{intervals}")
        _push_bulk(client, rng.choice(ids, per_interval, replace=False), rng)
        model.train(steps)
        for mode, kwargs in MODES.items():
            target = work / mode / f"ck-{k:03d}"
            t = time.perf_counter()
            manifest = client.checkpoint(str(target), **kwargs)
            seconds[mode] += time.perf_counter() - t
            bytes_[mode] += int(manifest["bytes"])
            if mode in ("full", "int8") and mode in last:
                shutil.rmtree(last[mode])  # superseded: a full checkpoint needs no base
            last[mode] = target
    for mode in MODES:
        met = bytes_[mode] <= TARGET_BYTES_RATIO * bytes_["full"] if mode == "incremental_int8" else None
        emit("checkpoint.bytes", "bytes", bytes_[mode], "full checkpoints", bytes_["full"], mode=mode,
             target_ratio=TARGET_BYTES_RATIO if mode == "incremental_int8" else None, met=met, **params)
        emit("checkpoint.seconds", "s", seconds[mode], "full checkpoints", seconds["full"], mode=mode, **params)
    restored: dict[str, tuple[float, float]] = {}
    for mode in MODES:  # full first: the peer of the others
        log(f"bench checkpoint: restore {mode}")
        t = time.perf_counter()
        counts = client.restore_checkpoint(str(last[mode]))
        took = time.perf_counter() - t
        if counts.get("bulk") != rows:
            raise RuntimeError(f"restore {mode}: {counts.get('bulk')} bulk rows restored, {rows} checkpointed")
        restored[mode] = (took, model.auc(eval_rows))
    full_s, full_auc = restored["full"]
    for mode, (took, auc) in restored.items():
        emit("checkpoint.restore_seconds", "s", took, "full checkpoint", full_s, mode=mode, **params)
        delta = auc - full_auc
        emit("checkpoint.auc", "auc", auc, "after the full restore", full_auc, mode=mode, auc_delta=round(delta, 6),
             target_abs_delta=TARGET_AUC_DELTA, met=abs(delta) <= TARGET_AUC_DELTA, **params)
