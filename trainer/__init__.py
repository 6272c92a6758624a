"""tigana.trainer — CTR models trained through the parameter server.

Embedding tables live on the shard servers (``PSEmbeddingBags``: rows pulled per batch, prefetched one
step ahead within the staleness bound, row gradients pushed asynchronously from a custom autograd function);
the dense layers are replicated on every trainer and kept in sync by DDP with a hierarchical all-reduce
(reduce in the node, all-reduce among node leaders, broadcast in the node).

Example::

    from tigana import ps
    from tigana.trainer import PSEmbeddingBags, TableOptions
    from tigana.trainer.models import build_model

    client = ps.connect(["127.0.0.1:7101", "127.0.0.1:7102"])
    emb = PSEmbeddingBags(client, features, dim=16, options=TableOptions(optimizer=ps.Adagrad(lr=0.05)))
    model = build_model("deepfm", emb, num_dense=13)
    optimizer = torch.optim.Adam(model.dense_parameters())  # the tables are not parameters

A TorchRec model swaps its ``EmbeddingBagCollection`` for ``PSEmbeddingBagCollection(client, tables)`` and its
``EmbeddingCollection`` for ``PSEmbeddingCollection(client, tables)`` (TorchRec's configs, KeyedJaggedTensor and
outputs, or ours from ``tigana.trainer.keyed``). ``PSEmbeddingCollection(client, features, dim)``, the pooled
collection's old name, still builds a ``PSEmbeddingBags`` (deprecated).

Or the whole job from the command line: ``tigana train --config train.yaml`` (or
``torchrun --nproc-per-node N -m tigana.trainer ...``), whose last stdout line is a JSON result.
"""

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {  # public name -> the module that defines it
    "cross_node_bytes": "tigana.trainer.allreduce",
    "flat_all_reduce": "tigana.trainer.allreduce",
    "hierarchical_all_reduce": "tigana.trainer.allreduce",
    "hierarchical_hook": "tigana.trainer.allreduce",
    "register_hook": "tigana.trainer.allreduce",
    "PSEmbeddingBagCollection": "tigana.trainer.bag_collection",
    "ConfigError": "tigana.trainer.config",
    "TrainConfig": "tigana.trainer.config",
    "add_arguments": "tigana.trainer.config",
    "config_from_args": "tigana.trainer.config",
    "load_config": "tigana.trainer.config",
    "DistEnv": "tigana.trainer.launcher_env",
    "Groups": "tigana.trainer.distributed",
    "init_distributed": "tigana.trainer.distributed",
    "read_env": "tigana.trainer.launcher_env",
    "shutdown": "tigana.trainer.distributed",
    "PSEmbeddingBags": "tigana.trainer.embedding",
    "PSEmbeddingCollection": "tigana.trainer.sequence_collection",
    "TableOptions": "tigana.trainer.embedding",
    "EmbeddingBagConfig": "tigana.trainer.keyed",
    "EmbeddingConfig": "tigana.trainer.keyed",
    "JaggedTensor": "tigana.trainer.keyed",
    "KeyedJaggedTensor": "tigana.trainer.keyed",
    "KeyedTensor": "tigana.trainer.keyed",
    "PoolingType": "tigana.trainer.keyed",
    "run": "tigana.trainer.launch",
    "LocalEmbeddingCollection": "tigana.trainer.local",
    "TrainData": "tigana.trainer.loop",
    "evaluate": "tigana.trainer.loop",
    "load_data": "tigana.trainer.loop",
    "train": "tigana.trainer.loop",
    "Batch": "tigana.trainer.types",
    "EmbeddingCollection": "tigana.trainer.types",
    "FeatureSpec": "tigana.trainer.types",
    "SparseFeatures": "tigana.trainer.types",
    "Publisher": "tigana.trainer.publish",
    "CriteoScorer": "tigana.trainer.predict",
    "load_scorer": "tigana.trainer.predict",
}

__all__ = [
    "Batch", "ConfigError", "CriteoScorer", "DistEnv", "EmbeddingBagConfig", "EmbeddingCollection", "FeatureSpec", "Groups",
    "EmbeddingConfig", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "LocalEmbeddingCollection",
    "PSEmbeddingBagCollection", "PSEmbeddingBags", "PSEmbeddingCollection",
    "PoolingType", "Publisher", "SparseFeatures", "TableOptions", "TrainConfig", "TrainData", "add_arguments",
    "config_from_args", "cross_node_bytes", "evaluate", "flat_all_reduce", "hierarchical_all_reduce",
    "hierarchical_hook", "init_distributed", "load_config", "load_data", "load_scorer", "read_env", "register_hook", "run",
    "shutdown", "train",
]


def __getattr__(name: str) -> Any:
    """The public names are imported on first use: ``tigana train``'s launcher reads the config and data checks
    of this package without importing torch, which its trainer processes do."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tigana.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the names, for type checkers and editors
    from tigana.trainer.allreduce import (
        cross_node_bytes,
        flat_all_reduce,
        hierarchical_all_reduce,
        hierarchical_hook,
        register_hook,
    )
    from tigana.trainer.bag_collection import PSEmbeddingBagCollection
    from tigana.trainer.config import ConfigError, TrainConfig, add_arguments, config_from_args, load_config
    from tigana.trainer.distributed import Groups, init_distributed, shutdown
    from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
    from tigana.trainer.keyed import (
        EmbeddingBagConfig,
        EmbeddingConfig,
        JaggedTensor,
        KeyedJaggedTensor,
        KeyedTensor,
        PoolingType,
    )
    from tigana.trainer.launch import run
    from tigana.trainer.launcher_env import DistEnv, read_env
    from tigana.trainer.local import LocalEmbeddingCollection
    from tigana.trainer.loop import TrainData, evaluate, load_data, train
    from tigana.trainer.sequence_collection import PSEmbeddingCollection
    from tigana.trainer.types import Batch, EmbeddingCollection, FeatureSpec, SparseFeatures
