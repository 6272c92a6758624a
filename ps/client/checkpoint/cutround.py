"""CutRound: the coordinator's decisions of one cluster cut (sans-IO: events in, actions out; no socket, thread
or clock), driven by ``tigana.ps.client.checkpoint.write`` over gRPC and checkable alone.

The round, for the primaries of one route (the server side is ``tigana.ps.shard.cuts``):

    prepare every server  --all prepared-->  commit every server  --all committed, one epoch, the led slots
                                                                     a partition of every slot-->  read the parts
    any refusal, or commits that disagree  -->  release every server touched, start again (a new round)

Why the checks after the commits: each server records the slots it leads under its write locks, at its cut.
Map installs take the same locks, so no install lands between a server's prepare and its cut; but one may land
on one server before its prepare and on another after its cut. Then their epochs differ, or a slot is led twice
or by nobody, and the round is discarded rather than read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Commit", "CutRound", "Failed", "Read", "Release"]


@dataclasses.dataclass(frozen=True)
class Commit:
    """Send CommitCut to these servers (every one prepared)."""

    servers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Read:
    """The cut is whole: read each table's part from each server."""

    servers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Release:
    """Send ReleaseCut to these servers."""

    servers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Failed:
    """The round is over without a cut (after the Release before it); ``reason`` says why."""

    reason: str


Action = Commit | Read | Release | Failed


class CutRound:
    """One round of a cluster cut over ``servers`` (addresses) of a cluster of ``num_slots`` slots."""

    def __init__(self, servers: list[str], num_slots: int) -> None:
        if not servers:
            raise ValueError("a cut needs at least one server")
        self.servers = tuple(servers)
        self.num_slots = num_slots
        self.phase = "preparing"  # -> committing -> read | failed
        self._prepared: set[str] = set()
        self._committed: dict[str, tuple[int, np.ndarray]] = {}
        self._touched: set[str] = set()
        self._released: set[str] = set()

    def prepared(self, server: str) -> list[Action]:
        """``server`` answered PrepareCut (its writes are held)."""
        self._touched.add(server)
        if self.phase == "failed":
            return self._fail("")  # released at once: the round is over
        if self.phase != "preparing":
            return []
        self._prepared.add(server)
        if len(self._prepared) == len(self.servers):
            self.phase = "committing"
            return [Commit(self.servers)]
        return []

    def refused(self, server: str, reason: str) -> list[Action]:
        """``server`` refused or did not answer PrepareCut or CommitCut (it may have taken its locks anyway)."""
        self._touched.add(server)
        return self._fail(f"server {server}: {reason}")

    def committed(self, server: str, epoch: int, slots: np.ndarray) -> list[Action]:
        """``server`` took its cut at map ``epoch``, leading ``slots``."""
        if self.phase != "committing":
            return []
        self._committed[server] = (int(epoch), np.asarray(slots, np.int64))
        if len(self._committed) < len(self.servers):
            return []
        epochs = {e for e, _ in self._committed.values()}
        if len(epochs) > 1:
            return self._fail(f"the servers cut at different map epochs {sorted(epochs)} (a map change landed)")
        led = np.concatenate([s for _, s in self._committed.values()])
        counts = np.bincount(led, minlength=self.num_slots) if led.size else np.zeros(self.num_slots, np.int64)
        if counts.size != self.num_slots or (counts != 1).any():
            bad = np.flatnonzero(counts[:self.num_slots] != 1)
            return self._fail(f"{bad.size} slot(s) led by no server or by two at the cut (a map change landed)")
        self.phase = "read"
        return [Read(self.servers)]

    def done(self) -> list[Action]:
        """The parts are read (or reading failed): release every server."""
        return [Release(tuple(sorted(self._touched | set(self._committed))))]

    def _fail(self, reason: str) -> list[Action]:
        # Every server touched is released once the round fails, also one whose refusal comes after the failure
        # (it may hold its locks: a PrepareCut that timed out here can have prepared there).
        new = tuple(sorted((self._touched | set(self._committed)) - self._released))
        self._released.update(new)
        out: list[Action] = [Release(new)] if new else []
        if self.phase != "failed":
            self.phase = "failed"
            out.append(Failed(reason))
        return out
