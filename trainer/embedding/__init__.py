"""tigana.trainer.embedding — embedding tables that live on the parameter server, as a torch module.

forward(sparse) -> (B, F, dim):

    values of each table ──sort──> distinct ids ──pull once each──> (U, dim) rows of every table, stacked
         │                            (or the rows prefetched while the previous step ran)      │
         └── index of each value's row ──────────┐                                            │
                                                 └──> _PooledLookup: gather (single-hot) or
                                                      embedding_bag (sum; 1/len weights for mean) ──> (F*B, dim)
    backward: d(F*B, dim) ──segmented sum over each id's values──> d(U, dim) ──push (async)──> shard servers

No table ever has a dense gradient: the only gradient computed is the (U, dim) one of the distinct rows this
batch used, summed by the custom autograd function itself (the values are grouped by row once, when the batch
is planned) and sent to the shard servers instead of to an optimizer; the servers apply the table's own
optimizer. The collection has no parameters, so the dense optimizer and DDP never see the tables.

Fused tables (``fused_table``): every logical table is stored in one PS table, its ids salted per table
(a bijection, so tables stay apart), and a step costs one pull and one push per shard instead of one per table.

Staleness: a table created with ``staleness=k`` lets the rows a step reads miss the pushes of at most the
``k`` previous steps of this trainer (the client holds a pull back until the older pushes are acknowledged,
without blocking the caller). ``prefetch(next_batch)`` overlaps the pull of step t+1 with step t's compute,
which needs k >= 1 (the rows cannot include step t's own pushes); with k = 0 every pull waits for every
earlier push and prefetch does nothing. Pushes of other trainers are never waited for (asynchronous SGD).

Hot-row cache (``TableOptions.cache_rows``, ``tigana.trainer.cache``): training forwards read the rows of hot
ids from copies pulled earlier while each copy is within the table's staleness bound (per row: this
trainer's own pushes it misses, counted at every push; the invariant is in ``cache``), and pull only the
rest. A prefetch decides which rows the cache will serve counting the pushes of the steps that run before
its forward; the forward checks again and pulls any row that is no longer servable. With a cache the misses
are pulled with a client bound of 0 (a pull reflects every push issued before it), so the whole staleness
budget goes to the cache. Evaluation (read-only) forwards never use it.

Adaptive compression (``TableOptions(compression="adaptive")``, ``tigana.trainer.compression``): each PS
table's pull and push codecs are chosen per step from the measured quantization error, pushes carry error
feedback and top-k sparsification, and a guard backs off to full precision; ``flush`` delivers every
gradient still held. ``observe_loss`` feeds the guard the training loss.

Hierarchical sparse aggregation (``aggregate_group``): the ranks of one node gather their (ids, grads) at the
node leader, which sums the rows of equal ids and pushes once for the node.

Thread-safety: one collection per trainer thread; forward/backward/prefetch must come from one thread.

Rooms: ``options`` (TableOptions), ``collection`` (the module: tables, forward, prefetch, flush), ``plan``
(a batch's distinct ids and row grouping), ``pooling`` (the autograd function), ``pulls`` (pulls and the
hot-row cache), ``pushes`` (row gradients to the servers), ``aggregate`` (hierarchical sparse aggregation).
"""

import warnings
from typing import Any

from tigana.trainer.embedding.collection import PSEmbeddingBags
from tigana.trainer.embedding.options import COMPRESSIONS, TableOptions

__all__ = ["COMPRESSIONS", "PSEmbeddingBags", "TableOptions"]


def __getattr__(name: str) -> Any:
    """``PSEmbeddingCollection``, this collection's old name (deprecated): TorchRec calls a pooling collection a
    *bag* collection, so the name now belongs to ``tigana.trainer.PSEmbeddingCollection``, the drop-in for
    TorchRec's ``EmbeddingCollection``, which still builds a ``PSEmbeddingBags`` (with a DeprecationWarning)
    when called the old way."""
    if name == "PSEmbeddingCollection":
        warnings.warn("tigana.trainer.embedding.PSEmbeddingCollection is deprecated: use PSEmbeddingBags (pooled "
                      "rows, the same arguments)", DeprecationWarning, stacklevel=2)
        return PSEmbeddingBags
    raise AttributeError(f"module 'tigana.trainer.embedding' has no attribute {name!r}")
