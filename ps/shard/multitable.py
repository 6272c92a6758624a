"""The server's side of multi-table frames (``frames.PULLS``/``PUSHES``): one frame carrying several tables'
parts for this server (a step of a model with many tables), handled in one pass and answered as one message.

Why: a frame costs a decode, permit and deadline checks, a metrics observation and an answer whatever its
size, and a step of a model with 26 tables paid that 26 times per server in each direction. Here it is paid
once; what stays per part is the table's own work.

Order, and what it guarantees:

1. Every part is checked against its table first (table known, ids, codec, dims, sizes, and NaN/Inf gradients
   where the table rejects them: ``WritePath.pull_check``/``push_check``), before any is read or applied: bad
   input refuses the whole frame with one error naming the table and field, and applies nothing of it.
2. One wait for room in the replication queue (back-pressure), for the whole frame.
3. Each part then runs as a single-table frame would: under its table's lock, fenced by its own leads check
   at its own epoch, a push applied exactly once per slot by its own (client id, seq) (the dedup window is per
   table). A part refused there, by the table's state rather than by its input (a slot this server no longer
   leads, ``min_copies``, the primary lease, an update that would make a row's state non-finite), gets its own
   error answer and changes nothing of its table; the client re-routes that part alone, the other parts stand.
4. A push frame is answered once every part's in-sync copies have it (one wait on all the parts' marks, no
   thread held: ``streams.Deferred``); a part whose copies did not acknowledge in time answers ``Unavailable``
   (applied here: its retry is a duplicate that waits for the copies again).

Thread-safety: runs on a stream's reader thread (the deferred answer on whichever thread settles the wait).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tigana.ps import rpc
from tigana.ps.replication import Replicator
from tigana.ps.shard.streams import Deferred
from tigana.ps.shard.writes import WritePath
from tigana.ps.wire import frames

log = logging.getLogger("tigana.ps.server")


def part_error(exc: BaseException, method: str, epoch: int) -> bytes:
    """A part's error answer (id 0, inside its frame's answer); a bug is logged as the frame's would be."""
    rpc.answer_status(exc, f"{method} frame part", log)
    return frames.error_answer(0, exc, epoch)


def pull_many(writes: WritePath, frame_id: int, requests: list, timeout_s: float | None) -> bytes:
    """Answer a multi-table pull frame: every part checked, then each table's rows read (see the module
    docstring). Raises (the whole frame's error) only before anything was read or inserted."""
    plans = [writes.pull_check(r) for r in requests]
    inserting = [p for p in plans if not p.read_only]
    if inserting:  # a pull that may insert enqueues its rows to the copies
        writes.wait_for_room(inserting[0].name, timeout_s)
    answers = []
    for p in plans:
        try:
            answers.append(frames.pull_answer(0, writes.pull_read(p), p.codec))
        except Exception as exc:  # noqa: BLE001 - this part's error; the others stand
            answers.append(part_error(exc, "Pull", writes.holdings.epoch))
    return frames.many_answer(frame_id, answers)


def push_many(writes: WritePath, replicator: Replicator | None, frame_id: int, requests: list,
              timeout_s: float | None, ack_timeout_s: float) -> bytes | Deferred:
    """Answer a multi-table push frame: every part checked, then each applied exactly once; the answer, or
    (sync parts waiting for their copies) a ``Deferred`` that the copies' acknowledgements settle. Raises (the
    whole frame's error) only before anything was applied."""
    plans = [writes.push_check(r, finite=len(requests) > 1) for r in requests]
    writes.wait_for_room(plans[0].name, timeout_s)
    pushed: list[Any] = []
    for p in plans:
        try:
            pushed.append(writes.push_commit(p))
        except Exception as exc:  # noqa: BLE001 - this part's error (nothing of its table applied)
            pushed.append(exc)
    marks = [m for p in pushed if not isinstance(p, BaseException) for m in p.marks]

    def answer(done: bool) -> bytes:
        parts = []
        for p in pushed:
            if isinstance(p, BaseException):
                parts.append(part_error(p, "Push", writes.holdings.epoch))
                continue
            try:
                parts.append(frames.push_answer(0, writes.push_answer(p, done)))
            except Exception as exc:  # noqa: BLE001 - applied here, not acknowledged: the part retries
                parts.append(part_error(exc, "Push", writes.holdings.epoch))
        return frames.many_answer(frame_id, parts)

    if not marks or replicator is None:
        return answer(True)

    def start(finish: Callable[[Callable[[], bytes]], None]) -> None:
        # made by whoever settles the wait (the last acknowledgement, a map, the deadline)
        replicator.when_done(marks, ack_timeout_s, lambda done: finish(lambda: answer(done)))
    return Deferred(start)
