"""A drop-in for TorchRec's ``EmbeddingCollection`` (unpooled: one row per id, for sequence models such as
DIN, BST or transformer recommenders) whose tables live on the parameter server::

    - ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"), need_indices=False)
    + ec = PSEmbeddingCollection(ps.connect(scheduler="sched:7100"), tables,
    +                            options=TableOptions(optimizer=ps.SGD(lr=0.1)))
      out = ec(kjt)      # KeyedJaggedTensor in, {key: JaggedTensor of (sum of lengths, dim)} out

TorchRec's ``EmbeddingConfig`` list (every table the same ``embedding_dim``, as TorchRec requires) and
``KeyedJaggedTensor`` in, TorchRec's ``JaggedTensor`` out when the batch is TorchRec's; without TorchRec, the
same types from ``tigana.trainer.keyed``. Weights in the batch are ignored, as TorchRec's ``EmbeddingCollection``
ignores them; ``need_indices=True`` gives each ``JaggedTensor`` the ids as its weights, as TorchRec does.

How: every id becomes a bag of one in one ``PSEmbeddingBags`` (one pull and one push per table a step, the
rows of ids repeated in the batch pulled once and their gradients summed before the push)::

    feature f's N_f ids ──> N_f bags of one, then B' - N_f empty bags (B' = max_f N_f)
        ──> (B', F, dim) ──> feature f's rows [:N_f] ──> JaggedTensor(values (N_f, dim), lengths (B,))

The old ``PSEmbeddingCollection(client, features, dim, ...)`` (FeatureSpecs and one dim: the pooled
collection now called ``PSEmbeddingBags``) still builds a ``PSEmbeddingBags``, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tigana.trainer.dropin import DEFAULT_STATE_DICT_ROWS, DropIn, from_torchrec
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.keyed import JaggedTensor
from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["PSEmbeddingCollection"]


def _old_call(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call names the pooled collection's old signature (features as FeatureSpecs, a dim)."""
    features = args[1] if len(args) > 1 else kwargs.get("features")
    return "dim" in kwargs or len(args) > 2 or (
        isinstance(features, Sequence) and any(isinstance(f, FeatureSpec) for f in features))


class PSEmbeddingCollection(DropIn):
    """TorchRec's ``EmbeddingCollection`` interface over PS tables.

    client:        a ``tigana.ps`` client (``ps.connect``)
    tables:        EmbeddingConfig objects (TorchRec's or ``tigana.trainer.keyed``'s): name, embedding_dim (the
                   same for all), num_embeddings (sizes the state dict's tensor), feature_names (empty: the
                   table's name)
    device:        where the rows go (CUDA: copied from pinned memory without blocking)
    need_indices:  each output JaggedTensor carries its ids as ``weights()``
    use_gather_select, use_gather_select_per_sharding: TorchRec's, accepted and answered (they choose a
                   sharded module's lookup kernel; there is none to choose here)
    options, table_options, table_prefix, output, state_dict_rows, checkpoint_dir: as
                   ``PSEmbeddingBagCollection``'s
    """

    _tables_attr = "embeddings"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if _old_call(args, kwargs):
            warnings.warn("PSEmbeddingCollection(client, features, dim) is deprecated: the pooled collection is "
                          "PSEmbeddingBags (the same arguments); PSEmbeddingCollection is now the drop-in for "
                          "TorchRec's EmbeddingCollection", DeprecationWarning, stacklevel=2)
            return PSEmbeddingBags(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, client: Any, tables: Sequence[Any], *, device: torch.device | str | None = None,
                 need_indices: bool = False, use_gather_select: bool = False,
                 use_gather_select_per_sharding: Mapping[str, bool] | None = None, options: TableOptions | None = None,
                 table_options: Mapping[str, TableOptions] | None = None, table_prefix: str = "",
                 output: str = "auto", state_dict_rows: int = DEFAULT_STATE_DICT_ROWS,
                 checkpoint_dir: str | None = None, **collection_kwargs: Any) -> None:
        super().__init__()
        dims = {t.name: int(t.embedding_dim) for t in tables}
        if len(set(dims.values())) > 1:
            raise ValueError(f"All tables in a EmbeddingCollection are required to have same embedding dimension: "
                             f"got {dims}")
        self._weighted = False
        self._need_indices = bool(need_indices)
        # TorchRec's lookup-kernel choices for its sharded modules: kept and answered, nothing to choose here
        self._use_gather_select = bool(use_gather_select)
        self._use_gather_select_per_sharding = use_gather_select_per_sharding
        self._build(client, tables, dict.fromkeys(dims, "sum"), options=options, table_options=table_options,
                    table_prefix=table_prefix, device=device, state_dict_rows=state_dict_rows,
                    checkpoint_dir=checkpoint_dir, collection_kwargs=collection_kwargs, output=output)
        self._embedding_dim = next(iter(dims.values())) if dims else 0

    def need_indices(self) -> bool:
        return self._need_indices

    def use_gather_select(self) -> bool:
        return self._use_gather_select

    def use_gather_select_per_sharding(self) -> Mapping[str, bool] | None:
        return self._use_gather_select_per_sharding

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> list[Any]:
        """The tables, as given."""
        return self._configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Per table, the keys of its outputs (``feature`` or ``feature@table``)."""
        return [[o.key for o in self.outputs if o.table == t.name] for t in self._configs]

    def forward(self, features: Any) -> dict[str, Any]:
        """KeyedJaggedTensor (keys in any order, extra keys ignored) -> {output key: JaggedTensor}: each
        feature's rows, (its number of ids, dim) float32 on ``device``, with the batch's lengths of that feature."""
        (sparse,) = self._split(features)
        nf, batch = len(sparse.keys), sparse.lengths.numel() // max(len(sparse.keys), 1)
        per_key = sparse.lengths.view(nf, batch)  # (F, B)
        counts = per_key.sum(1)  # (F,) ids per feature
        width = int(counts.max()) if nf else 0
        # feature f: counts[f] bags of one id, then empty bags up to the widest feature
        singles = (torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)).long()  # (F, B')
        if width:
            rows = self.groups[0](SparseFeatures(keys=sparse.keys, values=sparse.values,
                                                 lengths=singles.reshape(-1)))  # (B', F, dim)
        else:  # no ids at all: nothing to pull
            rows = torch.zeros(0, nf, self._embedding_dim, device=self.device)
        torchrec = self.output == "torchrec" or (self.output == "auto" and from_torchrec(features))
        if torchrec:
            from torchrec.sparse.jagged_tensor import JaggedTensor as Jagged
        else:
            Jagged = JaggedTensor  # noqa: N806
        ends = torch.cumsum(counts, 0).tolist()
        out = {}
        for j, key in enumerate(sparse.keys):
            n = int(counts[j])
            ids = sparse.values[ends[j] - n:ends[j]] if self._need_indices else None
            lengths = per_key[j].to(rows.device)
            out[key] = Jagged(values=rows[:n, j, :], lengths=lengths,
                              weights=None if ids is None else ids.to(rows.device))
        return out
