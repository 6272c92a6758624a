"""A drop-in for TorchRec's ``EmbeddingBagCollection`` whose tables live on the parameter server.

A TorchRec model built on ``EmbeddingBagCollection(tables=[EmbeddingBagConfig(...), ...])`` trains through
the PS by swapping that one module::

    - ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    + ebc = PSEmbeddingBagCollection(ps.connect(scheduler="sched:7100"), tables,
    +                                options=TableOptions(optimizer=ps.SGD(lr=0.1)))
      model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, ...)
      kt = ebc(kjt)      # KeyedJaggedTensor in, KeyedTensor out, as before

It takes TorchRec's ``EmbeddingBagConfig`` list (each table its own ``embedding_dim``, feature names and
pooling) and ``KeyedJaggedTensor`` when TorchRec is installed, and returns TorchRec's ``KeyedTensor`` for them;
without TorchRec, the same types from ``tigana.trainer.keyed``. TorchRec is never imported unless the caller's
objects come from it.

    KJT (keys in any order) ──split per feature──> one PSEmbeddingCollection per distinct embedding_dim
        (B, F_d, d) pooled rows each ──> columns of the features in table order ──> KeyedTensor (B, sum of dims)

The tables are not parameters: the dense optimizer sees only the model's dense layers, the row gradients go
to the servers, which apply each table's optimizer (``TableOptions``; per table through ``table_options``).
Thread-safety: as ``PSEmbeddingCollection``: one thread drives forward and backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tigana.trainer.embedding import PSEmbeddingCollection, TableOptions
from tigana.trainer.keyed import KeyedTensor
from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["PSEmbeddingBagCollection"]


def _pooling(config: Any) -> str:
    """"sum" or "mean" of a TorchRec or tigana EmbeddingBagConfig (an enum, or its name as text)."""
    raw = getattr(config, "pooling", "SUM")
    text = str(getattr(raw, "value", raw)).upper()
    if text not in ("SUM", "MEAN"):
        raise ValueError(f"table {config.name!r}: pooling {text} is not supported (SUM or MEAN)")
    return text.lower()


def _from_torchrec(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torchrec"


class PSEmbeddingBagCollection(nn.Module):
    """TorchRec's ``EmbeddingBagCollection`` interface over PS tables.

    client:        a ``tigana.ps`` client (``ps.connect``)
    tables:        EmbeddingBagConfig objects (TorchRec's or ``tigana.trainer.keyed``'s): name, embedding_dim,
                   feature_names, pooling (SUM or MEAN); ``num_embeddings`` is not a bound on a PS table
    options:       TableOptions of every table (optimizer, initializer, staleness, ...); ``table_options``
                   overrides them per table name
    table_prefix:  prepended to the PS table names (jobs sharing a cluster)
    output:        "auto" (TorchRec's KeyedTensor for TorchRec's KeyedJaggedTensor, else ours), "torchrec" or
                   "tigana"
    """

    def __init__(self, client: Any, tables: Sequence[Any], *, options: TableOptions | None = None,
                 table_options: Mapping[str, TableOptions] | None = None, table_prefix: str = "",
                 output: str = "auto", **collection_kwargs: Any) -> None:
        super().__init__()
        if not tables:
            raise ValueError("a PSEmbeddingBagCollection needs at least one table")
        if output not in ("auto", "torchrec", "tigana"):
            raise ValueError(f"output must be auto, torchrec or tigana, got {output!r}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"table names must be distinct and non-empty, got {names}")
        features = [f for t in tables for f in t.feature_names]
        if len(set(features)) != len(features):
            raise ValueError(f"a feature may be read by one table only, got {features}")
        self._configs = list(tables)
        self.output = output
        self.feature_names: list[str] = features  # TorchRec's output order: by table, then by feature
        self._dim_of = {f: int(t.embedding_dim) for t in tables for f in t.feature_names}
        by_dim: dict[int, list[FeatureSpec]] = {}
        for t in tables:
            for f in t.feature_names:
                by_dim.setdefault(int(t.embedding_dim), []).append(
                    FeatureSpec(name=f, table=table_prefix + t.name, pooling=_pooling(t)))  # type: ignore[arg-type]
        overrides = {table_prefix + name: o for name, o in (table_options or {}).items()}
        self.groups = nn.ModuleList()
        for dim, specs in by_dim.items():
            mine = {t: o for t, o in overrides.items() if t in {s.table_name for s in specs}}
            self.groups.append(PSEmbeddingCollection(client, specs, dim, options=options, table_options=mine,
                                                     **collection_kwargs))

    def embedding_bag_configs(self) -> list[Any]:
        """The tables, as given (TorchRec's models read them: DLRM's SparseArch takes D and F from here)."""
        return self._configs

    def forward(self, features: Any) -> Any:
        """KeyedJaggedTensor (its keys in any order, a superset of ours allowed) -> KeyedTensor of
        (B, sum of the features' dims) float32, features in ``feature_names`` order."""
        keys = list(features.keys())
        values, lengths = features.values(), features.lengths()
        batch = lengths.numel() // max(len(keys), 1)
        per_key = lengths.view(len(keys), batch)  # (F_in, B)
        totals = per_key.sum(1).tolist()
        starts = [0]
        for n in totals:
            starts.append(starts[-1] + int(n))
        where = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.feature_names if f not in where]
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks features {missing} (it has {keys})")
        columns: dict[str, torch.Tensor] = {}
        for group in self.groups:
            names = group.feature_names
            idx = [where[f] for f in names]
            sparse = SparseFeatures(keys=list(names),
                                    values=torch.cat([values[starts[i]:starts[i + 1]] for i in idx]).long(),
                                    lengths=per_key[idx].reshape(-1).long())
            pooled = group(sparse)  # (B, F_group, dim)
            for j, name in enumerate(names):
                columns[name] = pooled[:, j, :]
        out = torch.cat([columns[f] for f in self.feature_names], dim=1)  # (B, sum of dims)
        widths = [self._dim_of[f] for f in self.feature_names]
        if self.output == "torchrec" or (self.output == "auto" and _from_torchrec(features)):
            from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKeyedTensor

            return TorchRecKeyedTensor(keys=list(self.feature_names), length_per_key=widths, values=out)
        return KeyedTensor(list(self.feature_names), widths, out)

    def flush(self) -> None:
        """Wait for every push in flight (each group's)."""
        for group in self.groups:
            group.flush()

    def stats(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for group in self.groups:
            for k, v in group.stats().items():
                if isinstance(v, dict):
                    merged.setdefault(k, {}).update(v)
                else:
                    merged[k] = merged.get(k, 0) + v
        return merged

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}(dim={t.embedding_dim}, features={list(t.feature_names)})" for t in self._configs)
