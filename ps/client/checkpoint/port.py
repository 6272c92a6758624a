"""``CheckpointPort``: what a checkpoint, a restore or an export needs of a client, and nothing more.

Checkpoints are a client operation: they route by the client's current map and call the servers' stubs, but
they do not reach into the client's fields. ``Client.checkpoint_port()`` gives one (``tigana.ps.client.tables``);
a test may give another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tigana.proto import shard_pb2 as pb
from tigana.ps.client.config import ClientConfig
from tigana.ps.client.routes import Route
from tigana.ps.errors import PSError

if TYPE_CHECKING:
    from tigana.ps.client.tables import TableInfo


class CheckpointPort(Protocol):
    """A client, as checkpoints use it. Thread-safety: every method may be called from any thread."""

    @property
    def config(self) -> ClientConfig:
        """The client's settings (``num_slots``, ``timeout_s``, ``admin_timeout_s``, ``failover_timeout_s``,
        ``chunk_bytes``)."""
        ...

    def route(self) -> Route:
        """The routing snapshot new operations take now: its epoch, its servers (each with its ``stub``) and
        the primary of every slot."""
        ...

    def retryable(self, error: PSError) -> bool:
        """Whether a new attempt, routed again by the newest map, can succeed after ``error``."""
        ...

    def follow_map(self) -> None:
        """Ask the scheduler for a map newer than the route's (nothing with a static shard list)."""
        ...

    def flush(self) -> None:
        """Wait for every push of this client in flight."""
        ...

    def list_tables(self) -> list[str]: ...

    def describe_table(self, name: str) -> TableInfo: ...

    def drop_table(self, name: str) -> bool: ...

    def table_spec(self, name: str) -> pb.TableSpec:
        """The table's spec as the servers hold it (with durability and min_copies)."""
        ...

    def create_from_spec(self, spec: pb.TableSpec) -> None:
        """Create a table (absent) exactly as ``spec`` says, on every server."""
        ...
