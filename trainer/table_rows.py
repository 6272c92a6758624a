"""One table of a TorchRec drop-in as TorchRec names it (``ebc.embedding_bags[name]``, ``ec.embeddings[name]``),
and what its state dict holds.

A TorchRec table is a tensor of ``num_embeddings`` rows; a PS table holds any int64 ids, as many as trained.
So a state dict holds either of two things per table:

- ``<prefix>weight``: TorchRec's key and tensor, (num_embeddings, embedding_dim) float32, row i the row of id i
  (ids the table does not hold yet: the row training would start them from, ``unseen="initial"``), when
  ``num_embeddings <= max_rows`` and the table holds no id outside [0, num_embeddings). A TorchRec module loads
  it as its own, and loading it here writes row i as id i into the PS table (one import of every row).
- ``<prefix>_extra_state`` otherwise: a dict saying where the rows are saved, a *cluster checkpoint*
  (``{"saved_by": "cluster checkpoint", "checkpoint": DIR or None, "ps_table": ..., "rows": ..., "why": ...}``):
  with ``checkpoint_dir`` set, ``state_dict()`` writes one (``client.checkpoint``) under it and names it, and
  ``load_state_dict`` restores it; without, the rows stay on the cluster, saved by its own checkpoints
  (``tigana admin checkpoint``), and loading the entry checks that it names this table and writes nothing.

Either round-trips through ``torch.save``/``torch.load`` and ``load_state_dict`` without loss; nothing is
dropped silently.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:  # PSEmbeddingBags builds PSTables of its own: no import at run time
    from tigana.trainer.embedding import PSEmbeddingBags

__all__ = ["DEFAULT_STATE_DICT_ROWS", "FORMAT", "PSTable", "check_state_dict"]

DEFAULT_STATE_DICT_ROWS = 1 << 20  # tables up to this many rows are saved as TorchRec's tensor
FORMAT = "tigana.ps-table/1"


class PSTable(nn.Module):
    """One table on the PS, as TorchRec's ``nn.EmbeddingBag``/``nn.Embedding`` of a collection stands in the
    module tree: no parameters, its state dict entry as the module docstring says. ``num_embeddings`` None: the
    table is not bounded (any int64 id), so its entry is always the ``_extra_state`` one.

    ``weight``: the (num_embeddings, embedding_dim) rows of ids 0..num_embeddings-1 now, a read-only copy
    (writing to it changes nothing on the PS: ``load_state_dict`` does)."""

    def __init__(self, group: PSEmbeddingBags, name: str, table: str, num_embeddings: int | None, embedding_dim: int, *,
                 max_rows: int, checkpoint_dir: str | None) -> None:
        super().__init__()
        self._group = [group]  # not a child: the group is the drop-in's
        self.name = name  # TorchRec's table name
        self.table = table  # the group's (logical) table: the PS table, or a table in the group's fused one
        self.num_embeddings = None if num_embeddings is None else int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.max_rows = int(max_rows)
        self.checkpoint_dir = checkpoint_dir

    @property
    def group(self) -> PSEmbeddingBags:
        return self._group[0]

    @property
    def ps_table(self) -> str:
        return self.group.ps_ids(self.table, np.empty(0, np.int64))[0]

    @property
    def weight(self) -> torch.Tensor:
        rows, why = self._bounded_rows()
        if rows is None:
            raise ValueError(f"table {self.name!r}: {why}; its rows are read with table_rows(table, ids)")
        return torch.from_numpy(rows)

    def _bounded_rows(self) -> tuple[np.ndarray | None, str]:
        """(num_embeddings, dim) rows of ids 0..n-1 if they are the whole table, else (None, why not)."""
        n = self.num_embeddings
        if self.group.fused_table is not None:
            return None, f"it shares the fused PS table {self.group.fused_table!r} with other tables"
        if n is None:
            return None, "it is not bounded by a num_embeddings (any int64 id)"
        if n > self.max_rows:
            return None, f"num_embeddings {n} is over the {self.max_rows} rows a state dict tensor holds"
        self.group.flush()
        physical, ids = self.group.ps_ids(self.table, np.arange(n, dtype=np.int64))
        client = self.group.client
        # which of 0..n-1 the table holds: a held row reads the same under any policy, an unheld one as told
        held = np.all(client.pull(physical, ids, insert=False, unseen=0.0) ==
                      client.pull(physical, ids, insert=False, unseen=1.0), axis=1)
        total = client.describe_table(physical).rows
        if total != int(held.sum()):
            return None, f"it holds {total - int(held.sum())} ids outside [0, {n})"
        return np.asarray(self.group.table_rows(self.table, ids), np.float32), ""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        rows, why = self._bounded_rows()
        if rows is not None:
            destination[prefix + "weight"] = torch.from_numpy(rows)
            return
        checkpoint = None
        if self.checkpoint_dir is not None:
            self.group.flush()  # with the gradients adaptive compression still holds
            checkpoint = os.path.join(self.checkpoint_dir, f"{self.ps_table}-{time.time_ns()}")
            self.group.client.checkpoint(checkpoint, tables=[self.ps_table])
        destination[prefix + "_extra_state"] = {
            "format": FORMAT, "saved_by": "cluster checkpoint", "checkpoint": checkpoint, "ps_table": self.ps_table,
            "embedding_dim": self.embedding_dim, "num_embeddings": self.num_embeddings,
            "rows": self.group.client.describe_table(self.ps_table).rows,
            "why": f"table {self.name!r}: {why}" + ("" if checkpoint else
                                                      "; the rows stay on the cluster (its own checkpoints)")}

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        ours = (prefix + "weight", prefix + "_extra_state")
        for key in state_dict:
            if key.startswith(prefix) and key not in ours:
                unexpected_keys.append(key)
        if ours[0] in state_dict:
            rows = state_dict[ours[0]]
            self.group.write_rows(self.table, np.arange(rows.shape[0], dtype=np.int64), rows)
        elif ours[1] in state_dict:
            checkpoint = state_dict[ours[1]]["checkpoint"]
            if checkpoint is not None:
                self.group.flush()
                self.group.client.restore_checkpoint(checkpoint, tables=[self.ps_table])
                for cache in self.group.caches.values():  # cached rows predate the restored ones
                    cache.clear()
        elif strict:
            missing_keys.append(ours[0])


def check_state_dict(table: PSTable, state_dict: Mapping[str, Any], prefix: str) -> None:
    """Raise ``ValueError`` naming the table unless ``state_dict``'s entry for ``table`` (if any) is one it
    loads: a (rows <= num_embeddings if bounded, embedding_dim) finite float tensor, or an entry of this format for its
    PS table and dim."""
    weight, extra = state_dict.get(prefix + "weight"), state_dict.get(prefix + "_extra_state")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 or \
                weight.shape[1] != table.embedding_dim or \
                (table.num_embeddings is not None and weight.shape[0] > table.num_embeddings):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            rows = "n" if table.num_embeddings is None else table.num_embeddings
            raise ValueError(f"table {table.name!r}: {prefix}weight is {shape}, expected float rows "
                             f"({rows}, {table.embedding_dim})")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError(f"table {table.name!r}: {prefix}weight holds NaN or Inf")
    elif extra is not None:
        if not isinstance(extra, Mapping) or extra.get("format") != FORMAT:
            raise ValueError(f"table {table.name!r}: {prefix}_extra_state is not a {FORMAT} entry")
        if extra.get("ps_table") != table.ps_table or extra.get("embedding_dim") != table.embedding_dim:
            raise ValueError(f"table {table.name!r}: {prefix}_extra_state is PS table {extra.get('ps_table')!r} "
                             f"of dim {extra.get('embedding_dim')}, this one is {table.ps_table!r} of dim "
                             f"{table.embedding_dim}")
