"""CTR models built from an embedding collection plus torch dense layers.

Each takes ``(embeddings, num_dense, **options)`` and maps ``forward(dense (B, num_dense), sparse) -> logits
(B,)``. Give ``model.dense_parameters()`` (not ``parameters()``) to the dense optimizer: see ``base``.

Example::

    from tigana.trainer.models import build_model
    model = build_model("deepfm", embeddings, num_dense=13, hidden=(256, 128))
    loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
"""

from __future__ import annotations

from typing import Any

from tigana.trainer.models.base import EMBEDDING_PREFIXES, CTRModel
from tigana.trainer.models.dcn_v2 import DCNv2
from tigana.trainer.models.deepfm import DeepFM
from tigana.trainer.models.dlrm import DLRM
from tigana.trainer.models.layers import MLP, CrossNetwork, FirstOrder, dot_interaction, fm_interaction
from tigana.trainer.models.wide_deep import WideDeep
from tigana.trainer.types import EmbeddingCollection

__all__ = [
    "EMBEDDING_PREFIXES", "MLP", "MODELS", "CTRModel", "CrossNetwork", "DCNv2", "DLRM", "DeepFM", "FirstOrder",
    "WideDeep", "build_model", "dot_interaction", "fm_interaction",
]

MODELS: dict[str, type[CTRModel]] = {"deepfm": DeepFM, "dlrm": DLRM, "wide_deep": WideDeep, "dcn_v2": DCNv2}


def build_model(name: str, embeddings: EmbeddingCollection, num_dense: int, **options: Any) -> CTRModel:
    """The model registered as ``name`` (deepfm, dlrm, wide_deep, dcn_v2); options go to its constructor."""
    key = name.lower().replace("-", "_").replace("&", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)}")
    return MODELS[key](embeddings, num_dense, **options)
