"""Data for the trainer: readers that yield ``tigana.trainer.types.Batch`` objects, one part per rank.

- ``CriteoReader``: streams a Criteo DAC text file (or the Kaggle CSV) in blocks; TorchRec's log(x + 3)
  for counts, salted 63-bit hashing for categorical values.
- ``MovieLens100K`` / ``load_movielens``: the MovieLens-100K ratings as a CTR task (label = rating >= 4).
- ``SyntheticCriteo``: a seeded Criteo-format generator (Zipf ids, a learnable label), in memory, streamed,
  or written as a DAC file.
- ``InMemoryDataset``: any of them held in numpy arrays, cut into per-rank, optionally shuffled batches.

Every reader takes ``rank`` and ``world_size``; the ranks' parts are disjoint and together hold every row.

Example::

    from tigana.trainer.data import MovieLens100K
    ml = MovieLens100K("../shared/data/movielens-100k/ml-100k")
    train = ml.train()
    for batch in train.batches(1024, rank=0, world_size=2, shuffle=True, epoch=0):
        ...
"""

from tigana.trainer.data.criteo import (
    DENSE_NAMES,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_NAMES,
    CriteoChunk,
    CriteoFormatError,
    CriteoReader,
    chunk_to_batch,
    criteo_feature_specs,
    criteo_salts,
    format_dac,
    parse_criteo,
    transform_dense,
)
from tigana.trainer.data.hashing import feature_salt, hash_values, missing_id, mix64
from tigana.trainer.data.memory import InMemoryDataset, gather_bags, rank_rows
from tigana.trainer.data.movielens import MOVIELENS_FEATURES, MovieLens100K, load_movielens
from tigana.trainer.data.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    SyntheticConfig,
    SyntheticCriteo,
    zipf_ranks,
)

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES", "DENSE_NAMES", "MOVIELENS_FEATURES", "NUM_DENSE", "NUM_SPARSE", "SPARSE_NAMES",
    "CriteoChunk", "CriteoFormatError", "CriteoReader", "InMemoryDataset", "MovieLens100K", "SyntheticConfig",
    "SyntheticCriteo", "chunk_to_batch", "criteo_feature_specs", "criteo_salts", "feature_salt", "format_dac",
    "gather_bags", "hash_values", "load_movielens", "missing_id", "mix64", "parse_criteo", "rank_rows",
    "transform_dense", "zipf_ranks",
]
