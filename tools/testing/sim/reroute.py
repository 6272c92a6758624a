"""L7 re-route, after every step (docs/replication.md): no trainer's part in flight still waits on a server that
the map its client routes by no longer names as the primary of every slot the part carries. The client gives such
a part up when it installs the map and routes it again at once (``tigana.ps.client.sentparts``); a part left
waiting would sit out its deadline (8 s here) or keepalive while its slots' new primary is up.

Read from the real client (``Client.parts_stranded``): every map reaches it as an event of the simulated world,
and its re-route runs as another event at the same instant, so by the end of a step none may be left."""

from __future__ import annotations

from typing import Any

__all__ = ["stranded"]


def stranded(clients: list[Any]) -> list[str]:
    """The violations of L7 now over the run's trainers (``realclient.RealSimClient``)."""
    out = []
    for c in clients:
        client = c.client
        if client is None:
            continue
        n = client.parts_stranded
        if n:
            out.append(f"L7: {c.name} has {n} part(s) in flight to servers its map at epoch {client.epoch} no longer "
                       "names as the primary of their slots (not routed again)")
    return out
