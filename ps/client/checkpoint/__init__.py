"""tigana.ps.client.checkpoint — cluster checkpoints, restores and serving exports, through the primaries of a live
cluster.

A checkpoint is one cut of every table of the cluster at one point of its history, taken without the trainers'
help (``cutround``: every primary holds writes, then cuts every table at once; see ``tigana.ps.shard.cuts``):
a write is in it only with every write acknowledged before it was sent, and a row's weights and optimizer
state come from the same write. Written as::

    DIR/manifest.json                 format, version 2, created, epoch, num_slots, kind (full | incremental),
                                      base (path and manifest sha256 of an incremental's base), quantize,
                                      cut (time, each server's clock), bytes, and per table: spec, dim,
                                      state_width, step, rows, since, deleted, bytes and parts (each with its
                                      server, the slots it led, their log positions, full, and its files)
    DIR/tables/<table>/part-<server>/ chunk files of numpy arrays with a sha256 each (``parts``)

into a temp folder renamed into place, so a crash never leaves a checkpoint that loads. ``incremental`` writes
the rows changed since a base checkpoint and the ids removed since; ``quantize`` (``fp16``, ``int8``) the
weights at lower precision, the optimizer state exact unless ``quantize_state``. A restore reads the chain
newest first, recreates every table and writes the rows through the primaries the cluster has now
(``ImportRows``, replicated like pushes): any number of servers, and a full-precision chain comes back
bit-identical, so training continues as from the cut.

A client operation: every function takes a ``CheckpointPort`` (``port``: the client's current route and its
servers' stubs, its map follower, its table calls; ``Client.checkpoint_port()`` gives one), never the client.
"""

from tigana.ps.client.checkpoint.export import export_table
from tigana.ps.client.checkpoint.port import CheckpointPort
from tigana.ps.client.checkpoint.restore import (
    checkpoint_rows,
    import_rows,
    read_chain,
    read_manifest,
    restore_checkpoint,
)
from tigana.ps.client.checkpoint.write import write_checkpoint

__all__ = ["CheckpointPort", "checkpoint_rows", "export_table", "import_rows", "read_chain", "read_manifest", "restore_checkpoint", "write_checkpoint"]
