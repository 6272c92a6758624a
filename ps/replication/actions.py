"""What the replication core asks its adapter to do: the actions ``Primary``'s events return.

The core decides; the adapter (threads and gRPC in the daemon, the world in the simulator) does, after
releasing its lock, in the order given:

- ``OpenStream`` / ``CloseStream``: the transport to a target (a channel and a sender for each stream);
- ``StartCopy``: export a slot copy's rows (the server's tables; ``Primary.enqueue_rows`` per chunk, then
  ``rows_copied`` or ``copy_failed``);
- ``ReportFailure`` / ``ReportCaughtUp``: the calls to the scheduler (a stale caught-up report answered
  False goes back as ``Primary.report_refused``);
- ``RefreshMap``: learn the map of at least this epoch before anything else of the answer that carried it;
- ``Pause``: the sender waits this long before its next send (a simulator's clock spaces it instead).

A map's actions (``Replicator.on_map``, called under the server's install and table locks) go back to the
server, which carries them out (``Replicator.run``) once it has released those locks: a report is a call to the
scheduler, and no RPC or wait runs under a table or install lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tigana.ps.replication.copy import Session
    from tigana.ps.replication.stream import Stream


@dataclass(frozen=True, eq=False)
class OpenStream:
    stream: Stream


@dataclass(frozen=True, eq=False)
class CloseStream:
    stream: Stream


@dataclass(frozen=True, eq=False)
class StartCopy:
    stream: Stream
    session: Session


@dataclass(frozen=True, eq=False)
class ReportFailure:
    target: str
    slots: np.ndarray
    reason: str
    epoch: int = 0  # the primary's map epoch when it saw the failure (the scheduler ignores it for slots changed since)


@dataclass(frozen=True, eq=False)
class ReportCaughtUp:
    stream: Stream
    session: Session


@dataclass(frozen=True)
class RefreshMap:
    epoch: int


@dataclass(frozen=True)
class Pause:
    seconds: float


Action = OpenStream | CloseStream | StartCopy | ReportFailure | ReportCaughtUp | RefreshMap | Pause
