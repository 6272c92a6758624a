"""``tigana bench quality --data DIR [--quick]``: the price of every knob in model quality and wire bytes.

DeepFM (dim 16) on MovieLens-100K fold 1 (train u1.base, score u1.test; read from ``--data``, never copied),
trained once per setting with the same seed, the same batches in the same order, the same dense
initialization and the same initial rows (the PS's deterministic initializer; the local tables start from
those rows), Adam on the dense layers and Adagrad on the rows (server-side, or ``torch.optim.Adagrad`` on
sparse gradients locally: the same equations). Settings:

==============  ==========================================================================================
``local``       no PS: ``nn.EmbeddingBag`` tables in this process (the reference of ``auc_delta``)
``ps``          2 shard daemons, fp32 wire, staleness 1 with prefetch (the reference of ``wire_bytes_ratio``)
``fp16``        ``ps`` with fp16 rows and gradients on the wire
``int8``        ``ps`` with int8 (per-row scale) rows and gradients
``adaptive``    ``ps`` with adaptive compression (``tigana.trainer.compression``, default knobs)
``staleness=k`` ``ps`` at staleness 0 (read-your-writes, no prefetch), 4 and 16
``cache``       ``ps`` with a hot-row cache of 4,096 rows (``tigana.trainer.cache``), staleness 1
==============  ==========================================================================================

One JSON line per setting: ``case: "quality"``, ``setting``, ``auc``, ``logloss``, ``auc_delta`` (against
``local``), ``wire_bytes_ratio`` (every byte of the data path, pulls and pushes both ways, against ``ps``;
also split into ``pull_bytes_ratio`` and ``push_bytes_ratio``), ``samples_per_s`` (training only), and the
usual keys (``unit``: auc, ``value``, ``peer``: the local run, ``peer_value``, ``ratio``), the run's
parameters, the setting's ``target`` and whether it was ``met``.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tigana import ps
from tigana.ps.allocator import ALLOCATOR_ENV, tune_allocator
from tigana.tools.bench.report import emit, log
from tigana.trainer.data import MovieLens100K
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.loop import evaluate
from tigana.trainer.models import build_model
from tigana.trainer.types import Batch

DIM = 16
SEED = 0
CACHE_ROWS = 4096
AUC_TOLERANCE = 0.001
ADAPTIVE_MAX_RATIO = 0.25
SETTINGS = ("local", "ps", "fp16", "int8", "adaptive", "staleness=0", "staleness=4", "staleness=16", "cache")
# settings with a target on |auc_delta|; adaptive also has one on its wire bytes
_AUC_TARGETS = ("ps", "fp16", "adaptive", "staleness=4", "cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="MovieLens-100K: the ml-100k folder or a folder holding it (read in place)")
    parser.add_argument("--quick", action="store_true",
                        help="1 epoch of 12 batches, scored on 2,048 rows of u1.test (a smoke test of every setting)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of u1.base (quick: 1)")
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per step")


def movielens_root(path: str) -> Path:
    """The folder holding u.user and u1.base: ``path`` or its ``ml-100k`` child."""
    root = Path(path)
    for candidate in (root, root / "ml-100k"):
        if (candidate / "u.user").is_file() and (candidate / "u1.base").is_file():
            return candidate
    raise FileNotFoundError(f"bench quality: no MovieLens-100K files (u.user, u1.base, u1.test) under {root}")


def options_of(setting: str) -> TableOptions:
    """The PS table of a setting (all: Adagrad lr 0.05 on the servers, rows from N(0, 0.01) with one seed)."""
    base = dict(optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.01), seed=SEED, staleness=1)
    if setting in ("fp16", "int8", "adaptive"):
        base["compression"] = setting
    elif setting.startswith("staleness="):
        base["staleness"] = int(setting.split("=", 1)[1])
    elif setting == "cache":
        base["cache_rows"] = CACHE_ROWS
    elif setting != "ps":
        raise ValueError(f"unknown setting {setting!r}")
    return TableOptions(**base)


class _Run:
    """One model, its optimizers and the data; ``train()`` runs every epoch and returns the training seconds."""

    def __init__(self, embeddings: nn.Module, ml: MovieLens100K, train: Any, epochs: int, batch_size: int,
                 steps: int | None, collection: PSEmbeddingBags | None = None) -> None:
        torch.manual_seed(SEED)  # the same dense initialization in every setting
        self.model = build_model("deepfm", embeddings, ml.num_dense)
        self.collection = collection
        self.dense_opt = torch.optim.Adam(self.model.dense_parameters(), lr=1e-3)
        sparse = list(embeddings.parameters()) if collection is None else []
        self.sparse_opt = torch.optim.Adagrad(sparse, lr=0.05) if sparse else None
        self.train_set, self.epochs, self.batch_size, self.steps = train, epochs, batch_size, steps
        self.samples = 0

    def _batches(self, epoch: int) -> list[Batch]:
        out = list(self.train_set.batches(self.batch_size, shuffle=True, seed=SEED, epoch=epoch))
        return out[:self.steps] if self.steps is not None else out

    def train(self) -> float:
        seconds = 0.0
        prefetch = self.collection is not None and self.collection.min_staleness >= 1
        for epoch in range(self.epochs):
            batches = self._batches(epoch)  # made before the clock starts: data is not timed
            t0 = time.perf_counter()
            for i, batch in enumerate(batches):
                if prefetch and i + 1 < len(batches):
                    self.collection.prefetch(batches[i + 1].sparse)
                loss = F.binary_cross_entropy_with_logits(self.model(batch.dense, batch.sparse), batch.labels)
                self.dense_opt.zero_grad(set_to_none=True)
                if self.sparse_opt is not None:
                    self.sparse_opt.zero_grad(set_to_none=True)
                loss.backward()
                self.dense_opt.step()
                if self.sparse_opt is not None:
                    self.sparse_opt.step()
                if self.collection is not None:
                    self.collection.observe_loss(float(loss.detach()))
                self.samples += len(batch)
            if self.collection is not None:
                self.collection.flush()  # every gradient delivered and applied: the epoch is done
            seconds += time.perf_counter() - t0
        return seconds


def _wire_bytes(client: ps.Client, table: str) -> dict[str, int]:
    stats = client.stats()
    sent, received = stats["bytes_sent"].get(table, {}), stats["bytes_received"].get(table, {})
    return {d: int(sent.get(d, 0) + received.get(d, 0)) for d in ("pull", "push")}


def run(args: argparse.Namespace) -> int:
    tune_allocator(top_pad=64 << 20)
    root = movielens_root(args.data)
    epochs = 1 if args.quick else args.epochs
    steps = 12 if args.quick else None
    ml = MovieLens100K(root)
    train_set, test_set = ml.train(), ml.test()
    if args.quick:
        test_set = test_set.subset(np.arange(min(2048, len(test_set))))
    params = dict(model="deepfm", dataset="movielens-100k u1", dim=DIM, epochs=epochs, batch_size=args.batch_size,
                  steps_per_epoch=steps or train_set.num_batches(args.batch_size), eval_rows=len(test_set),
                  seed=SEED, shards=2, embedding_optimizer="adagrad", embedding_lr=0.05, dense_lr=1e-3,
                  quick=bool(args.quick))
    results: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0", **ALLOCATOR_ENV)
    prefix = f"q{uuid.uuid4().hex[:6]}_"
    with ps.LocalCluster(2, replicas=None, env=env) as cluster:
        client = ps.connect(cluster.addresses)
        try:
            features = ml.feature_specs()
            # The local tables start from the PS's initial rows (the same seed gives every setting these rows).
            probe = PSEmbeddingBags(client, features, DIM, fused_table=f"{prefix}probe", options=options_of("ps"))
            init = {t: probe.table_rows(t, np.arange(ml.cardinalities[t])) for t in probe.tables}
            _warm_up(client, ml, train_set, args.batch_size, prefix)
            for setting in SETTINGS:
                log(f"bench quality: {setting}")
                if setting == "local":
                    local = LocalEmbeddingCollection(features, DIM, ml.cardinalities, weights=init, sparse_grad=True)
                    trainer = _Run(local, ml, train_set, epochs, args.batch_size, steps)
                    seconds = trainer.train()
                    scores = evaluate(trainer.model, test_set.batches(4096))
                    results[setting] = dict(scores, samples_per_s=trainer.samples / seconds, wire={"pull": 0, "push": 0})
                    continue
                table = f"{prefix}{setting.replace('=', '')}"
                coll = PSEmbeddingBags(client, features, DIM, fused_table=table, options=options_of(setting))
                trainer = _Run(coll, ml, train_set, epochs, args.batch_size, steps, coll)
                seconds = trainer.train()
                wire = _wire_bytes(client, table)  # training only: evaluation reads are not counted
                scores = evaluate(trainer.model, test_set.batches(4096), coll)
                results[setting] = dict(scores, samples_per_s=trainer.samples / seconds, wire=wire,
                                        stats=coll.stats())
                _report(setting, results, params)
        finally:
            client.close()
    return 0


def _report(setting: str, results: dict[str, dict[str, Any]], params: dict[str, Any]) -> None:
    """Print ``setting``'s line (and ``local``'s before the first PS setting: it needs ``ps``'s bytes)."""
    if setting == "ps":
        _report_one("local", results, params)
    _report_one(setting, results, params)


def _report_one(setting: str, results: dict[str, dict[str, Any]], params: dict[str, Any]) -> None:
    r, local, base = results[setting], results["local"], results["ps"]
    base_total = sum(base["wire"].values())
    extra: dict[str, Any] = {}
    o = options_of(setting) if setting != "local" else None
    if o is not None:
        extra.update(staleness=o.staleness, compression=o.compression or "fp32", cache_rows=o.cache_rows)
        stats = r["stats"]
        for c in stats["cache"].values():
            extra.update(cache_hit_rate=round(c["hit_rate"], 4), cache_hits=c["hits"], cache_misses=c["misses"])
        for c in stats["compression"].values():
            extra.update(codec_steps=c["codec_steps"], push_rows_ratio=round(c["rows_sent"] / max(c["rows_given"], 1), 4),
                         guard_trips={"push": c["push_trips"], "pull": c["pull_trips"], "loss": c["loss_trips"]})
    delta = r["auc"] - local["auc"]
    ratio = sum(r["wire"].values()) / base_total if base_total else 0.0
    target: dict[str, float] = {}
    if setting in _AUC_TARGETS:
        target["abs_auc_delta_max"] = AUC_TOLERANCE
    if setting == "adaptive":
        target["wire_bytes_ratio_max"] = ADAPTIVE_MAX_RATIO
    met = None
    if target:
        met = abs(delta) <= AUC_TOLERANCE and (setting != "adaptive" or ratio <= ADAPTIVE_MAX_RATIO)
    emit("quality", "auc", r["auc"], "local nn.EmbeddingBag", local["auc"], setting=setting,
         auc=round(r["auc"], 5), logloss=round(r["logloss"], 5), auc_delta=round(delta, 5),
         wire_bytes_ratio=round(ratio, 4),
         pull_bytes_ratio=round(r["wire"]["pull"] / base["wire"]["pull"], 4) if base["wire"]["pull"] else 0.0,
         push_bytes_ratio=round(r["wire"]["push"] / base["wire"]["push"], 4) if base["wire"]["push"] else 0.0,
         wire_bytes=sum(r["wire"].values()), samples_per_s=round(r["samples_per_s"], 1), **extra,
         target=target or None, met=met, **params)


def _warm_up(client: ps.Client, ml: MovieLens100K, train_set: Any, batch_size: int, prefix: str) -> None:
    """A few untimed steps so the servers' kernels are compiled before any setting is timed."""
    coll = PSEmbeddingBags(client, ml.feature_specs(), DIM, fused_table=f"{prefix}warm", options=options_of("ps"))
    torch.manual_seed(SEED)
    model = build_model("deepfm", coll, ml.num_dense)
    for i, batch in enumerate(train_set.batches(batch_size)):
        F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels).backward()
        if i == 3:
            break
    coll.flush()
    client.drop_table(f"{prefix}warm")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
