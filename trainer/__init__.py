"""tigana.trainer — CTR models trained through the parameter server.

Embedding tables live on the shard servers (``PSEmbeddingCollection``: rows pulled per batch, prefetched one
step ahead within the staleness bound, row gradients pushed asynchronously from a custom autograd function);
the dense layers are replicated on every trainer and kept in sync by DDP with a hierarchical all-reduce
(reduce in the node, all-reduce among node leaders, broadcast in the node).

Example::

    from tigana import ps
    from tigana.trainer import PSEmbeddingCollection, TableOptions
    from tigana.trainer.models import build_model

    client = ps.connect(["127.0.0.1:7101", "127.0.0.1:7102"])
    emb = PSEmbeddingCollection(client, features, dim=16, options=TableOptions(optimizer=ps.Adagrad(lr=0.05)))
    model = build_model("deepfm", emb, num_dense=13)
    optimizer = torch.optim.Adam(model.dense_parameters())  # the tables are not parameters

A TorchRec model swaps its ``EmbeddingBagCollection`` for ``PSEmbeddingBagCollection(client, tables)``
(TorchRec's EmbeddingBagConfig list and KeyedJaggedTensor, or ours from ``tigana.trainer.keyed``).

Or the whole job from the command line: ``tigana train --config train.yaml`` (or
``torchrun --nproc-per-node N -m tigana.trainer ...``), whose last stdout line is a JSON result.
"""

from tigana.trainer.allreduce import (
    cross_node_bytes,
    flat_all_reduce,
    hierarchical_all_reduce,
    hierarchical_hook,
    register_hook,
)
from tigana.trainer.bag_collection import PSEmbeddingBagCollection
from tigana.trainer.config import ConfigError, TrainConfig, add_arguments, config_from_args, load_config
from tigana.trainer.distributed import DistEnv, Groups, init_distributed, read_env, shutdown
from tigana.trainer.embedding import PSEmbeddingCollection, TableOptions
from tigana.trainer.keyed import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType
from tigana.trainer.launch import run
from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.loop import TrainData, evaluate, load_data, train
from tigana.trainer.types import Batch, EmbeddingCollection, FeatureSpec, SparseFeatures

__all__ = [
    "Batch", "ConfigError", "DistEnv", "EmbeddingBagConfig", "EmbeddingCollection", "FeatureSpec", "Groups",
    "KeyedJaggedTensor", "KeyedTensor", "LocalEmbeddingCollection", "PSEmbeddingBagCollection", "PSEmbeddingCollection",
    "PoolingType", "SparseFeatures", "TableOptions", "TrainConfig", "TrainData", "add_arguments",
    "config_from_args", "cross_node_bytes", "evaluate", "flat_all_reduce", "hierarchical_all_reduce",
    "hierarchical_hook", "init_distributed", "load_config", "load_data", "read_env", "register_hook", "run",
    "shutdown", "train",
]
