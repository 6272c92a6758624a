"""The scorer ``tigana serve --model DIR`` predicts with: a published model's dense network over its served
tables, fed raw feature rows that it transforms and hashes exactly as the trainer's data reader did.

``load_scorer(spec, dense_file)`` (the ``Loader`` of ``tigana.ps.serving.model``) builds the model the run
trained (``model.json``: its name, fields, tables and dim) over a ``PSEmbeddingBags`` whose "client"
reads the served tables' rows, and loads a published version's dense weights into it. The collection is the
trainer's own: the same plan, the same per-table salts of a fused table, the same pooling; only its rows come
from the export logs instead of the shard servers. A prediction is ``sigmoid(model(dense, sparse))`` in eval
mode, as ``tigana.trainer.loop.evaluate`` scores a held-out row.

Input (Criteo's format, what ``model.json``'s ``input`` names): ``dense`` (n, 13) raw integer fields, NaN
where missing (the reader reads a missing one as 0), then ``log(max(x, -2) + 3)``; ``categorical`` (n, 26)
raw uint64 values (the reader's hex fields as integers, ``MISSING_RAW`` where missing), hashed with each
field's salt. An id the tables do not hold reads as the server's ``--unseen`` policy says (by default the one
``model.json`` records, the trainer's evaluation setting), so a prediction is the score evaluation gives.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from concurrent import futures as cf
from typing import Any

import numpy as np
import torch

from tigana.trainer.data.criteo import ids_to_batch, transform_dense
from tigana.trainer.data.hashing import hash_values
from tigana.trainer.embedding import PSEmbeddingBags
from tigana.trainer.types import FeatureSpec

__all__ = ["CriteoScorer", "load_scorer"]

Lookup = Callable[[str, np.ndarray], np.ndarray]


class _ServedRows:
    """The "client" of a serving collection: read-only pulls answered from the served tables' rows (their
    unseen ids filled by the served tables' own policy, so ``unseen`` here is not used)."""

    def __init__(self) -> None:
        self.lookup: Lookup | None = None

    def pull(self, table: str, ids: Any, *, insert: bool = True, unseen: str | None = None) -> np.ndarray:
        assert self.lookup is not None, "a prediction sets the lookup first"
        return self.lookup(table, np.ascontiguousarray(ids, np.int64))

    def pull_many(self, tables: Sequence[str], ids: Sequence[Any], *, insert: bool = True,
                  unique: bool = False, unseen: str | None = None) -> list[cf.Future]:
        out = []
        for table, part in zip(tables, ids, strict=True):
            fut: cf.Future = cf.Future()
            fut.set_result(self.pull(table, part))
            out.append(fut)
        return out


class CriteoScorer:
    """A published Criteo-format model (see the module docstring); ``predict`` is serialized by a lock (the
    collection keeps per-call state), each call running torch's own threads."""

    def __init__(self, spec: dict[str, Any], dense_file: bytes) -> None:
        from tigana.trainer.models import build_model

        if spec.get("input") != "criteo":
            raise ValueError(f"model.json: input {spec.get('input')!r} is not served (Criteo-format models are)")
        self.spec = spec
        self.num_dense, self.num_sparse = int(spec["num_dense"]), int(spec["num_sparse"])
        self.names = [f["name"] for f in spec["features"]]
        self.salts = np.array([int(s, 16) for s in spec["salts"]], np.uint64)
        self.transform = spec["dense_transform"]
        self._rows = _ServedRows()
        features = [FeatureSpec(f["name"], table=f["table"], pooling=f["pooling"]) for f in spec["features"]]
        self.collection = PSEmbeddingBags(self._rows, features, int(spec["dim"]),
                                          fused_table=spec.get("fused_table"), create=False)
        self.model = build_model(spec["model"], self.collection, self.num_dense)
        state = torch.load(io.BytesIO(dense_file), weights_only=True)
        self.model.load_dense_state_dict(state["model"])
        self.model.eval()
        self.finite = all(bool(torch.isfinite(v).all()) for v in state["model"].values() if v.is_floating_point())
        self._lock = threading.Lock()

    def predict(self, dense: np.ndarray, categorical: np.ndarray, lookup: Lookup) -> np.ndarray:
        """(n, num_dense) float32 raw, (n, num_sparse) uint64 raw -> (n,) float32 probabilities."""
        n = dense.shape[0]
        if n == 0:
            return np.empty(0, np.float32)
        x = transform_dense(np.nan_to_num(dense.astype(np.float64), nan=0.0), self.transform)
        ids = hash_values(categorical, self.salts)
        batch = ids_to_batch(x, ids, np.zeros(n, np.float32), self.names)
        with self._lock, torch.no_grad():
            self._rows.lookup = lookup
            try:
                logits = self.model(batch.dense, batch.sparse).float()
            finally:
                self._rows.lookup = None
        return torch.sigmoid(logits).numpy().astype(np.float32, copy=False)

    def ps_ids(self, feature: int, raw: np.ndarray) -> tuple[str, np.ndarray]:
        """(the PS table, ids) that raw values of field ``feature`` are stored under: hashed as the reader
        hashes them, then mapped by the collection (salted into a fused table)."""
        ids = hash_values(np.asarray(raw, np.uint64), self.salts[feature])
        return self.collection.ps_ids(self.collection.features[feature].table_name, ids)

    def canary_auc(self, path: str, lookup: Lookup) -> float:
        """The AUC on the labelled rows of the Criteo file ``path``, read by the trainer's reader (the same
        transform and salts as this model's; the gate of ``tigana serve --canary``)."""
        from torchmetrics.functional.classification import binary_auroc

        from tigana.trainer.data.criteo import CriteoReader

        reader = CriteoReader(path, 4096, dense_transform=self.transform)
        if not np.array_equal(reader.salts, self.salts):
            raise ValueError(f"canary {path}: the reader's salts differ from the model's")
        scores, labels = [], []
        with self._lock, torch.no_grad():
            self._rows.lookup = lookup
            try:
                for batch in reader:
                    scores.append(torch.sigmoid(self.model(batch.dense, batch.sparse).float()))
                    labels.append(batch.labels)
            finally:
                self._rows.lookup = None
        if not scores:
            raise ValueError(f"canary {path}: no rows")
        return float(binary_auroc(torch.cat(scores), torch.cat(labels).long()))


def load_scorer(spec: dict[str, Any], dense_file: bytes) -> CriteoScorer:
    """The ``Loader`` ``tigana serve --model`` builds each published version's scorer with."""
    return CriteoScorer(spec, dense_file)
