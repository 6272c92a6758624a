"""Publishing a training run's model for serving (``tigana train --publish-dir DIR --publish-every N|Ns``).

Rank 0 writes the model's description (``model.json``: the model, its tables, and how raw feature rows become
its inputs: the dense transform and each categorical field's hash salt, the ones the data reader used) at its
first publish, and its dense weights every ``--publish-every`` steps or seconds and at the end of the run, as
versions numbered by the training step (``tigana.ps.serving.modeldir``). The tables reach the folder through
``tigana admin export --follow --model DIR``; ``tigana serve --model DIR`` serves the whole model
(``tigana.trainer.predict``).

Dense parameters are the same on every rank (DDP), so rank 0's are the model's. A version's weights are a
copy taken at a step boundary, so a publish never holds a half-applied optimizer step.
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tigana.ps.serving import modeldir
from tigana.trainer.config import TrainConfig, publish_interval
from tigana.trainer.embedding import PSEmbeddingBags

__all__ = ["Publisher", "model_spec"]

log = logging.getLogger("tigana.trainer")


def model_spec(config: TrainConfig, collection: PSEmbeddingBags, num_dense: int) -> dict[str, Any]:
    """``model.json`` of a run over a Criteo-format data set (criteo, synthetic): both readers hash a raw
    categorical value with its field's salt, ``criteo_salts(0)``, and transform the integer fields with log3."""
    from tigana.trainer.data.criteo import SPARSE_NAMES, criteo_salts

    names = [f.name for f in collection.features]
    if names != SPARSE_NAMES:
        raise ValueError(f"publish: a Criteo-format model has the fields {SPARSE_NAMES}, this one {names}")
    return {"model": config.model, "dataset": config.dataset, "input": "criteo", "num_dense": int(num_dense),
            "num_sparse": len(names), "dense_transform": "log3",
            "salts": [f"{int(s):016x}" for s in criteo_salts(0)], "dim": collection.dim,
            "features": [{"name": f.name, "table": f.table_name, "pooling": f.pooling} for f in collection.features],
            "fused_table": collection.fused_table, "tables": list(collection.ps_tables), "unseen": config.unseen,
            "initializers": {t: _initializer(collection.options[collection.tables[0] if t == collection.fused_table
                                                                else t]) for t in collection.ps_tables}}


def _initializer(options: Any) -> dict[str, Any]:
    """A table's initializer and seed as ``model.json`` names them (``tigana serve --unseen initial``)."""
    return {"kind": options.initializer.kind, **options.initializer.params(), "seed": int(options.seed)}


class Publisher:
    """Rank 0's publisher of one run: ``due(step)`` says whether ``--publish-every`` has passed since the last
    publish, ``publish(step, model)`` writes a version (and ``model.json`` at the first one)."""

    def __init__(self, root: str | Path, spec: dict[str, Any], every: str, keep: int = 20) -> None:
        interval = publish_interval(every)
        if interval is None:
            raise ValueError(f"publish_every: must be a number of steps or seconds ending in s, got {every!r}")
        self.root, self.spec, self.keep = Path(root), spec, keep
        self.every_steps, self.every_s = interval
        self.last_step: int | None = None
        self._last_time = time.monotonic()
        self._spec_written = False

    @classmethod
    def for_run(cls, config: TrainConfig, collection: PSEmbeddingBags, num_dense: int, rank: int
                ) -> Publisher | None:
        """The run's publisher on rank 0 with ``--publish-dir``, else None."""
        if config.publish_dir is None or rank != 0:
            return None
        return cls(config.publish_dir, model_spec(config, collection, num_dense), config.publish_every,
                   config.publish_keep)

    def due(self, step: int) -> bool:
        if self.every_steps is not None:
            return step % self.every_steps == 0
        return time.monotonic() - self._last_time >= float(self.every_s or 0)

    def publish(self, step: int, model: nn.Module) -> dict[str, Any] | None:
        """Write the dense weights of ``model`` as version ``step`` (nothing when that step is published)."""
        if step == self.last_step:
            return None
        if not self._spec_written:
            modeldir.write_spec(self.root, self.spec)
            self._spec_written = True
        state = model.dense_state_dict() if hasattr(model, "dense_state_dict") else model.state_dict()
        buf = io.BytesIO()
        torch.save({"model": {k: v.detach().cpu().clone() for k, v in state.items()}}, buf)
        entry = modeldir.publish_dense(self.root, step, buf.getvalue(), keep=self.keep)
        self.last_step, self._last_time = step, time.monotonic()
        log.info("published dense version %d of %s to %s", step, self.spec["model"], self.root)
        return entry
