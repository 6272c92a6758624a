"""Which data a training run reads, and each rank's part of it: MovieLens-100K, seeded synthetic
Criteo-format rows, or Criteo files (``--data``: one file, or a folder such as the Kaggle DAC download).

Where the files are (``movielens_root``, ``criteo_files``) is ``trainer.inputs``, which ``check_inputs`` reads
before any process starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tigana.trainer.config import TrainConfig
from tigana.trainer.inputs import criteo_files, movielens_root
from tigana.trainer.types import Batch, FeatureSpec, SparseFeatures

__all__ = ["TrainData", "criteo_files", "load_data", "movielens_root"]

log = logging.getLogger("tigana.trainer")


@dataclass
class TrainData:
    """A rank's view of a data set: feature specs, dense width, and iterators over its part."""

    features: list[FeatureSpec]
    num_dense: int
    train_batches: Callable[[int], Iterator[Batch]]   # epoch -> this rank's training batches
    eval_batches: Callable[[], Iterator[Batch]]        # this rank's held-out batches
    description: str
    steps_per_epoch: int | None = None                 # this rank's training batches per epoch, when known


def _rows_of(batch: Batch, keep: torch.Tensor) -> Batch:
    """The rows ``keep`` (bool (B,)) of a single-hot batch."""
    nf = len(batch.sparse.keys)
    values = batch.sparse.values.view(nf, -1)[:, keep].reshape(-1)
    sparse = SparseFeatures(list(batch.sparse.keys), values, torch.ones_like(values))
    return Batch(batch.dense[keep], sparse, batch.labels[keep])


def load_data(config: TrainConfig, rank: int = 0, world_size: int = 1) -> TrainData:
    """The configured data set, partitioned for ``rank`` of ``world_size``."""
    from tigana.trainer import data as d  # the readers (imported late: only what a run needs)

    bs, ebs, seed = config.batch_size, config.eval_batch_size, config.seed

    def in_memory(source: Any, train_set: Any, test_set: Any, description: str) -> TrainData:
        """TrainData over in-memory train/test sets: this rank's part, training batches shuffled per epoch."""
        return TrainData(
            source.feature_specs(), source.num_dense,
            lambda epoch: train_set.batches(bs, rank=rank, world_size=world_size, shuffle=True, seed=seed,
                                            epoch=epoch),
            lambda: test_set.batches(ebs, rank=rank, world_size=world_size),
            description, train_set.num_batches(bs, rank, world_size))

    if config.dataset == "movielens-100k":
        ml = d.MovieLens100K(movielens_root(config.data))
        train_set, test_set = ml.train(), ml.test()
        return in_memory(ml, train_set, test_set,
                         f"movielens-100k u1.base ({len(train_set)} rows) / u1.test ({len(test_set)} rows)")
    if config.dataset == "synthetic":
        vocab = tuple(min(v, config.synthetic_vocab) for v in d.synthetic.CRITEO_KAGGLE_CARDINALITIES)
        gen = d.SyntheticCriteo(vocab_sizes=vocab, seed=seed)
        n_eval = max(config.synthetic_rows // 5, 1)
        return in_memory(gen, gen.dataset(config.synthetic_rows), gen.dataset(n_eval, start=config.synthetic_rows),
                         f"synthetic Criteo-format, {config.synthetic_rows} training rows / {n_eval} held-out rows")
    train_file, eval_file, unlabelled = criteo_files(config.data)

    def reader(path: Path, batch_size: int) -> Any:
        return d.CriteoReader(path, batch_size, rank=rank, world_size=world_size)

    if eval_file is not None:
        return TrainData(d.criteo_feature_specs(), d.criteo.NUM_DENSE, lambda epoch: iter(reader(train_file, bs)),
                         lambda: iter(reader(eval_file, ebs)), f"criteo {train_file.name} / {eval_file.name}")

    # One labelled file: every 10th row of this rank's part is held out.
    passed = "".join(f"; {f.name} has no labels" for f in unlabelled)
    if unlabelled:
        log.warning("data: %s has no click labels; evaluating on every 10th row of %s instead",
                    ", ".join(f.name for f in unlabelled), train_file.name)
    def split(batch_size: int, held_out: bool) -> Iterator[Batch]:
        seen = 0
        for batch in reader(train_file, batch_size):
            keep = (torch.arange(seen, seen + len(batch)) % 10 == 9) == held_out
            seen += len(batch)
            if bool(keep.any()):
                yield _rows_of(batch, keep)

    return TrainData(d.criteo_feature_specs(), d.criteo.NUM_DENSE, lambda epoch: split(bs, False),
                     lambda: split(ebs, True), f"criteo {train_file.name} (every 10th row held out{passed})")
