"""What ``bench scale`` measures: its curves, its cases, and the one table every point uses."""

from __future__ import annotations

from tigana import ps

CURVES = ("shards", "clients", "rows", "batch")
KINDS = ("pull", "push", "step")
TABLE = "scale"


def _create_table(client: ps.Client, dim: int) -> None:
    # Uniform, not the default Normal: the timed runs touch only pre-loaded rows, so the initializer only sets
    # how fast the pre-load inserts (Normal's per-row seeded draw is ~4x slower at dim 64).
    client.create_table(TABLE, dim=dim, optimizer=ps.Adagrad(lr=0.01), initializer=ps.Uniform(), staleness=1)
