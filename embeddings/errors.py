"""Errors of the storage engine. Every message names the table and the field or file at fault.

    EmbeddingError
    ├── InvalidArgument      bad ids/grads dtype or shape, dim mismatch, NaN/Inf gradients, bad config
    └── StorageError         the spill file or a snapshot
        ├── StorageFull      LMDB map full or disk full; nothing of the write is visible
        ├── CorruptStore     checksum mismatch or truncated data; names the file and the key
        └── SnapshotNotFound no snapshot (or a broken chain of increments) at a path

A failed call leaves the table exactly as it was.
"""

from __future__ import annotations


class EmbeddingError(Exception):
    """Base of every storage-engine error."""


class InvalidArgument(EmbeddingError, ValueError):
    """A request or configuration is malformed; nothing was changed."""


class StorageError(EmbeddingError):
    """The disk tier (spill file or snapshot store) failed."""


class StorageFull(StorageError):
    """The LMDB map or the disk is full; the write was rolled back."""


class CorruptStore(StorageError):
    """Stored data failed its checksum or is truncated."""


class SnapshotNotFound(StorageError):
    """No loadable snapshot where one was expected."""
