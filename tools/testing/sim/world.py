"""The simulated world: one seeded random source, a clock, an event queue and a network.

Everything the simulated cluster does happens in ``World.step``: events due by then run in (time, order)
order, on one thread, so a seed replays exactly. The network delivers a message after a random delay, or
loses it (a drop phase, a partition, a crashed or paused node); a call whose request or answer is lost fails
at its caller after ``timeout_s``, as a deadline would. A partition cuts both directions between two nodes.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Deferred", "Lost", "Net", "World"]


class Lost(Exception):
    """A call's request or answer never arrived (dropped, partitioned, the node crashed or paused)."""


class Deferred:
    """An answer a handler gives later (a sync push waits for its copies): ``resolve`` sends it."""

    def __init__(self) -> None:
        self._then: Callable[[Any, BaseException | None], None] | None = None
        self.done = False

    def then(self, fn: Callable[[Any, BaseException | None], None]) -> None:
        self._then = fn

    def resolve(self, result: Any, error: BaseException | None = None) -> None:
        if not self.done and self._then is not None:
            self.done = True
            self._then(result, error)


@dataclass
class World:
    seed: int
    now: float = 0.0
    trace: list[str] = field(default_factory=list)
    trace_limit: int = 20_000

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._queue: list[list] = []  # [time, order, fn or None (cancelled)]: (time, order) is unique
        self._order = 0

    def clock(self) -> float:
        return self.now

    def at(self, delay: float, fn: Callable[[], None]) -> list:
        """Run ``fn`` ``delay`` simulated seconds from now; the handle ``cancel`` takes."""
        self._order += 1
        event = [self.now + max(0.0, delay), self._order, fn]
        heapq.heappush(self._queue, event)
        return event

    @staticmethod
    def cancel(event: list) -> None:
        """Forget the event ``at`` returned, for one that would do nothing when it runs (a deadline of a call
        answered already): its function, and all it holds, is freed now rather than seconds later (a sync
        push's 8 s deadline kept every answered call's closures alive, and the collector walking them)."""
        event[2] = None

    def run_until(self, t: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= t:
            when, _, fn = heapq.heappop(queue)
            if when > self.now:
                self.now = when
            if fn is not None:
                fn()
        if t > self.now:
            self.now = t

    def log(self, text: str) -> None:
        if len(self.trace) < self.trace_limit:
            self.trace.append(f"{self.now:9.3f} {text}")


class Net:
    """Messages between named nodes. ``up(name)`` says whether a node answers (not crashed, not paused)."""

    def __init__(self, world: World, up: Callable[[str], bool]) -> None:
        self.world = world
        self.up = up
        self.cut: set[frozenset[str]] = set()
        self.drop = 0.0
        self.delay = (0.0005, 0.01)

    def reachable(self, src: str, dst: str) -> bool:
        return frozenset((src, dst)) not in self.cut and self.up(dst)

    def _lost(self, src: str, dst: str) -> bool:
        return not self.reachable(src, dst) or self.world.rng.random() < self.drop

    def call(self, src: str, dst: str, handler: Callable[[], Any], reply: Callable[[Any, BaseException | None], None],
             timeout_s: float = 1.0) -> None:
        """``handler()`` runs at ``dst`` when the request arrives; its result (or exception) travels back to
        ``reply(result, error)``. A lost request or answer: ``reply(None, Lost())`` after ``timeout_s``."""
        w = self.world

        def fail() -> None:
            reply(None, Lost(f"{src} -> {dst}: no answer"))

        if self._lost(src, dst):
            w.at(timeout_s, fail)
            return

        def arrive() -> None:
            if not self.up(dst):
                w.at(timeout_s, fail)
                return
            try:
                result, error = handler(), None
            except Exception as exc:  # noqa: BLE001 - an error answer travels back like a result
                result, error = None, exc
            if isinstance(result, Deferred):
                result.then(answer)
                return
            answer(result, error)

        def answer(result: Any, error: BaseException | None) -> None:
            if self._lost(dst, src):
                w.at(timeout_s, fail)
                return
            w.at(w.rng.uniform(*self.delay), lambda: reply(result, error))

        w.at(w.rng.uniform(*self.delay), arrive)

    def now_call(self, src: str, dst: str, handler: Callable[[], Any]) -> Any:
        """A call answered at once (a simplification for the scheduler links a server makes from inside
        another call); ``Lost`` when the link or the node is down, or the message is dropped."""
        if self._lost(src, dst):
            raise Lost(f"{src} -> {dst}: no answer")
        return handler()
