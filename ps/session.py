"""Client sessions for exactly-once pushes: a client id that carries a session stamp.

A push is deduplicated by (client id, seq) in a bounded window per table (``dedup.DedupWindow``). When the
window forgets a client (more than ``max_clients`` clients), it keeps only a *horizon*: the highest session
stamp of a client it forgot. A client it does not know whose stamp is at or below the horizon may be one it
forgot, so its push is refused with ``UnknownClient`` (nothing applied) rather than applied a second time; a
client whose stamp is above the horizon was never forgotten there, so the push is new. This is Kafka's
idempotent producer (producer id + epoch + sequence, ``UNKNOWN_PRODUCER_ID`` when the broker has expired the
producer's state) without the round trip that hands out producer ids: the stamp is a Lamport clock, the wall
clock in nanoseconds raised above every horizon the client has been refused at.

    client id = "<stamp: 16 hex digits>.<32 hex digits: uuid4>"   e.g. 18810e6c1f2a3b40.3f1c...e2

Ids of another form (tests, older clients) have stamp 0: once a window has forgotten any client, it refuses
them unless it knows them.

Example::

    cid = new_client_id()
    assert client_stamp(cid) > 0
    later = new_client_id(above=client_stamp(cid))  # a new session after an UnknownClient refusal
    assert client_stamp(later) > client_stamp(cid)
"""

from __future__ import annotations

import time
import uuid

__all__ = ["client_stamp", "new_client_id"]

_STAMP_DIGITS = 16


def new_client_id(above: int = -1) -> str:
    """A new session's client id, stamped with the wall clock (ns) or ``above + 1``, whichever is higher."""
    stamp = max(time.time_ns(), above + 1)
    return f"{stamp:0{_STAMP_DIGITS}x}.{uuid.uuid4().hex}"


def client_stamp(client_id: str) -> int:
    """The session stamp of ``client_id`` (0 for an id not made by ``new_client_id``)."""
    if len(client_id) <= _STAMP_DIGITS or client_id[_STAMP_DIGITS] != ".":
        return 0
    try:
        return int(client_id[:_STAMP_DIGITS], 16)
    except ValueError:
        return 0
