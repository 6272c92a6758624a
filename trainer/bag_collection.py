"""A drop-in for TorchRec's ``EmbeddingBagCollection`` whose tables live on the parameter server.

A TorchRec model built on ``EmbeddingBagCollection(tables=[EmbeddingBagConfig(...), ...])`` trains through
the PS by swapping that one module::

    - ebc = EmbeddingBagCollection(tables=tables, is_weighted=False, device=torch.device("cpu"))
    + ebc = PSEmbeddingBagCollection(ps.connect(scheduler="sched:7100"), tables, is_weighted=False,
    +                                options=TableOptions(optimizer=ps.SGD(lr=0.1)))
      model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, ...)
      kt = ebc(kjt)      # KeyedJaggedTensor in, KeyedTensor out, as before

It takes TorchRec's ``EmbeddingBagConfig`` list (each table its own ``embedding_dim``, feature names and
pooling) and ``KeyedJaggedTensor`` when TorchRec is installed, and returns TorchRec's ``KeyedTensor`` for them;
without TorchRec, the same types from ``tigana.trainer.keyed``. TorchRec is never imported unless the caller's
objects come from it.

    KJT (keys in any order) ──split per output──> one PSEmbeddingBags per distinct embedding_dim
        (B, F_d, d) pooled rows each ──> columns of the outputs in table order ──> KeyedTensor (B, sum of dims)

Weighted features (``is_weighted=True``, a KJT with ``weights``): each id's row is scaled by its weight
before the SUM, and so is the gradient pushed for it; as in TorchRec, MEAN tables refuse weights
(``NotImplementedError`` at the forward) and an unweighted collection ignores them.

The tables are not parameters: the dense optimizer sees only the model's dense layers, the row gradients go
to the servers, which apply each table's optimizer (``TableOptions``; per table through ``table_options``).
``embedding_bags[name]`` and ``state_dict()`` are TorchRec's, as ``tigana.trainer.table_rows`` describes.
Thread-safety: one thread drives forward and backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tigana.trainer.dropin import DEFAULT_STATE_DICT_ROWS, DropIn, from_torchrec
from tigana.trainer.embedding import TableOptions
from tigana.trainer.keyed import KeyedTensor

__all__ = ["PSEmbeddingBagCollection"]


def _pooling(config: Any) -> str:
    """"sum" or "mean" of a TorchRec or tigana EmbeddingBagConfig (an enum, or its name as text)."""
    raw = getattr(config, "pooling", "SUM")
    text = str(getattr(raw, "value", raw)).upper()
    if text not in ("SUM", "MEAN"):
        raise ValueError(f"table {config.name!r}: pooling {text} is not supported (SUM or MEAN)")
    return text.lower()


class PSEmbeddingBagCollection(DropIn):
    """TorchRec's ``EmbeddingBagCollection`` interface over PS tables.

    client:        a ``tigana.ps`` client (``ps.connect``)
    tables:        EmbeddingBagConfig objects (TorchRec's or ``tigana.trainer.keyed``'s): name, embedding_dim,
                   feature_names (empty: the table's name), pooling (SUM or MEAN); ``num_embeddings`` sizes
                   the state dict's tensor, it does not bound a PS table's ids
    is_weighted:   the batches carry per-id weights, applied in pooling and in the pushed gradient
    device:        where the pooled rows go (CUDA: copied from pinned memory without blocking)
    options:       TableOptions of every table (optimizer, initializer, staleness, ...); ``table_options``
                   overrides them per table name
    table_prefix:  prepended to the PS table names (jobs sharing a cluster)
    output:        "auto" (TorchRec's KeyedTensor for TorchRec's KeyedJaggedTensor, else ours), "torchrec" or
                   "tigana"
    state_dict_rows, checkpoint_dir: how ``state_dict()`` saves each table (``tigana.trainer.table_rows``)
    """

    _tables_attr = "embedding_bags"

    def __init__(self, client: Any, tables: Sequence[Any], *, is_weighted: bool = False,
                 device: torch.device | str | None = None, options: TableOptions | None = None,
                 table_options: Mapping[str, TableOptions] | None = None, table_prefix: str = "",
                 output: str = "auto", state_dict_rows: int = DEFAULT_STATE_DICT_ROWS,
                 checkpoint_dir: str | None = None, **collection_kwargs: Any) -> None:
        super().__init__()
        self._weighted = bool(is_weighted)
        self._build(client, tables, {t.name: _pooling(t) for t in tables}, options=options,
                    table_options=table_options, table_prefix=table_prefix, device=device,
                    state_dict_rows=state_dict_rows, checkpoint_dir=checkpoint_dir,
                    collection_kwargs=collection_kwargs, output=output)
        self.feature_names: list[str] = [o.key for o in self.outputs]  # TorchRec's output keys, in its order
        self._dim_of = {o.key: int(t.embedding_dim) for t in tables for o in self.outputs if o.table == t.name}
        self._mean_tables = [t.name for t in tables if _pooling(t) == "mean"]

    def is_weighted(self) -> bool:
        """Whether the batches' per-id weights are applied (TorchRec's ``is_weighted()``)."""
        return self._weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The tables, as given (TorchRec's models read them: DLRM's SparseArch takes D and F from here)."""
        return self._configs

    def forward(self, features: Any) -> Any:
        """KeyedJaggedTensor (its keys in any order, a superset of ours allowed; with weights when weighted) ->
        KeyedTensor of (B, sum of the outputs' dims) float32 on ``device``, outputs in ``feature_names`` order."""
        if self._weighted and self._mean_tables:
            raise NotImplementedError(f"tables {self._mean_tables}: per-id weights are only supported with SUM "
                                      "pooling, as in TorchRec (embedding_bag's per_sample_weights, mode='mean')")
        columns: dict[str, torch.Tensor] = {}
        for group, sparse in zip(self.groups, self._split(features), strict=True):
            pooled = group(sparse)  # (B, F_group, dim)
            for j, name in enumerate(sparse.keys):
                columns[name] = pooled[:, j, :]
        out = torch.cat([columns[f] for f in self.feature_names], dim=1)  # (B, sum of dims)
        widths = [self._dim_of[f] for f in self.feature_names]
        if self.output == "torchrec" or (self.output == "auto" and from_torchrec(features)):
            from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKeyedTensor

            return TorchRecKeyedTensor(keys=list(self.feature_names), length_per_key=widths, values=out)
        return KeyedTensor(list(self.feature_names), widths, out)
