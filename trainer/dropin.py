"""What the TorchRec drop-ins (``PSEmbeddingBagCollection``, ``PSEmbeddingCollection``) share: TorchRec's
tables read as our feature specs, a ``KeyedJaggedTensor`` split per group of tables, the module's device, and
its tables as TorchRec names them (``embedding_bags`` / ``embeddings``, with their state dict).

Tables as TorchRec reads them:

- a table without ``feature_names`` reads the feature named after the table (TorchRec fills them in the same
  way, on the config object);
- a feature read by several tables gives one output per table, keyed ``feature@table``; every other output is
  keyed by its feature;
- outputs come table by table, then feature by feature within a table.

Each group (the tables of one ``embedding_dim``) is one ``PSEmbeddingBags`` whose feature specs are named by
those output keys; a batch's ids for a key are the ids of its feature, so a feature read by two tables is sent
to both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.table_rows import DEFAULT_STATE_DICT_ROWS, PSTable, check_state_dict
from tigana.trainer.types import FeatureSpec, SparseFeatures

__all__ = ["DEFAULT_STATE_DICT_ROWS", "DropIn", "FeatureMissing", "from_torchrec", "table_outputs"]


class FeatureMissing(KeyError, ValueError):
    """A batch lacks a feature a table reads: a ``KeyError``, as TorchRec raises, that says which."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class _Output:
    """One output of a drop-in: its key, the feature it reads and the table it reads it with."""

    key: str          # the feature, or feature@table when several tables read it
    feature: str
    table: str        # the TorchRec table name


def from_torchrec(obj: Any) -> bool:
    """Whether ``obj`` is one of TorchRec's own objects (then TorchRec's types come back)."""
    return type(obj).__module__.split(".")[0] == "torchrec"


def table_outputs(tables: Sequence[Any]) -> list[_Output]:
    """The outputs of ``tables`` in TorchRec's order; fills empty ``feature_names`` with the table's name (on
    the config, as TorchRec does). Raises ``ValueError`` for missing or repeated table names."""
    names = [t.name for t in tables]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"table names must be distinct and non-empty, got {names}")
    for t in tables:
        if not t.feature_names:
            t.feature_names = [t.name]
        if len(set(t.feature_names)) != len(t.feature_names):
            raise ValueError(f"table {t.name!r}: feature_names repeat, got {list(t.feature_names)}")
    readers: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            readers[f] = readers.get(f, 0) + 1
    return [_Output(f"{f}@{t.name}" if readers[f] > 1 else f, f, t.name) for t in tables for f in t.feature_names]


class DropIn(nn.Module):
    """The part of a TorchRec drop-in that is not its forward: subclasses set ``_tables_attr`` (the name of
    the ``ModuleDict`` of tables: ``embedding_bags`` or ``embeddings``) and call ``_build``."""

    _tables_attr = "embedding_bags"

    def _build(self, client: Any, tables: Sequence[Any], poolings: Mapping[str, str], *,
               options: TableOptions | None, table_options: Mapping[str, TableOptions] | None, table_prefix: str,
               device: torch.device | str | None, state_dict_rows: int, checkpoint_dir: str | None,
               collection_kwargs: Mapping[str, Any], output: str) -> None:
        """The groups and tables of ``tables`` (``poolings``: table name -> "sum"/"mean"); ``output``: "auto"
        (TorchRec's types for TorchRec's inputs, else ours), "torchrec" or "tigana"."""
        if output not in ("auto", "torchrec", "tigana"):
            raise ValueError(f"output must be auto, torchrec or tigana, got {output!r}")
        self.output = output
        if not tables:
            raise ValueError(f"a {type(self).__name__} needs at least one table")
        if state_dict_rows < 0:
            raise ValueError(f"state_dict_rows must be >= 0, got {state_dict_rows}")
        self.outputs = table_outputs(tables)
        unknown = sorted(set(table_options or {}) - {t.name for t in tables})
        if unknown:
            raise ValueError(f"table_options name tables that are not in the collection: {unknown}")
        self._configs = list(tables)
        dim_of = {t.name: int(t.embedding_dim) for t in tables}
        by_dim: dict[int, list[_Output]] = {}
        for out in self.outputs:
            by_dim.setdefault(dim_of[out.table], []).append(out)
        overrides = {table_prefix + name: o for name, o in (table_options or {}).items()}
        self.groups = nn.ModuleList()
        self._group_outputs: list[list[_Output]] = []
        group_of: dict[str, PSEmbeddingBags] = {}
        for dim, outs in by_dim.items():
            specs = [FeatureSpec(name=o.key, table=table_prefix + o.table, pooling=poolings[o.table])  # type: ignore[arg-type]
                     for o in outs]
            mine = {t: o for t, o in overrides.items() if t in {s.table_name for s in specs}}
            group = PSEmbeddingBags(client, specs, dim, options=options, table_options=mine, table_state=False,
                                    **collection_kwargs)
            self.groups.append(group)
            self._group_outputs.append(outs)
            for o in outs:
                group_of[o.table] = group
        setattr(self, self._tables_attr, nn.ModuleDict({
            t.name: PSTable(group_of[t.name], t.name, table_prefix + t.name, int(t.num_embeddings), int(t.embedding_dim),
                            max_rows=state_dict_rows, checkpoint_dir=checkpoint_dir) for t in tables}))
        self._register_load_state_dict_pre_hook(self._check_state_dict)
        if device is not None:
            self.to(torch.device(device))

    # ------------------------------------------------------------------ batches
    def _split(self, features: Any) -> list[SparseFeatures]:
        """A ``KeyedJaggedTensor`` (keys in any order; extra keys ignored) -> each group's SparseFeatures:
        the ids, lengths and weights of its outputs' features, in the group's order."""
        if getattr(features, "variable_stride_per_key", lambda: False)():
            raise ValueError(f"a {type(self).__name__} takes one batch size for every feature: this "
                             "KeyedJaggedTensor has a batch size per feature (variable batch, VBE)")
        keys = list(features.keys())
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none() if self._weighted else None
        where = {k: i for i, k in enumerate(keys)}
        missing = list(dict.fromkeys(o.feature for o in self.outputs if o.feature not in where))
        if missing:
            raise FeatureMissing(f"the KeyedJaggedTensor lacks features {missing} (it has {keys}), which the "
                                 f"tables of this {type(self).__name__} read")
        if self._weighted and weights is None:
            raise ValueError(f"this {type(self).__name__} is weighted (is_weighted=True), the KeyedJaggedTensor "
                             f"has no weights")
        batch = lengths.numel() // max(len(keys), 1)
        per_key = lengths.view(len(keys), batch)  # (F_in, B)
        ends = torch.cumsum(per_key.sum(1), 0).tolist()
        starts = [0, *ends[:-1]]
        out = []
        for outs in self._group_outputs:
            idx = [where[o.feature] for o in outs]
            parts = [slice(int(starts[i]), int(ends[i])) for i in idx]
            out.append(SparseFeatures(
                keys=[o.key for o in outs], values=torch.cat([values[p] for p in parts]).long().cpu(),
                lengths=per_key[idx].reshape(-1).long().cpu(),
                weights=None if weights is None else torch.cat([weights[p] for p in parts]).float().cpu()))
        return out

    # ------------------------------------------------------------------ TorchRec's module interface
    @property
    def device(self) -> torch.device:
        """Where the outputs are (``device=``, or where ``.to()`` moved the module); the rows stay on the PS."""
        return self.groups[0]._device_marker.device

    def reset_parameters(self) -> None:
        """Every row starts again from its table's initializer (``TableOptions.initializer``): the PS tables
        are dropped and created again, for every trainer that shares them."""
        for group in self.groups:
            group.reset_tables()

    def _check_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
        """Before anything is written: every table's entry of ``state_dict`` fits (raises ``ValueError``
        naming the table otherwise), so a bad state dict changes no table."""
        for name, table in getattr(self, self._tables_attr).items():
            check_state_dict(table, state_dict, f"{prefix}{self._tables_attr}.{name}.")

    def flush(self) -> None:
        """Wait for every push in flight (each group's)."""
        for group in self.groups:
            group.flush()

    def stats(self) -> dict[str, Any]:
        """Rows pulled, pushed and cached, summed over the groups (per-table counters merged)."""
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

