"""What a checker already passed: the inputs it read last time, so that a step which changed none of them is not
checked again (most steps of a run touch one server and one table, or nothing a checker reads).

A checker names each of its subjects (a server and a table, say) and, for it, the objects it reads (compared by
identity: a map, a table, a server's process; held here, so that an id is never reused while kept) and the values
it reads (compared by ``==``: counters, ``bytes`` of arrays). ``again`` says whether the subject's inputs are
those it last passed with; the checker records a pass with ``passed``. A violation is never recorded: the run
stops at its first.

``Passed.verify`` (a test sets it) makes ``again`` always False, and checks each skip it would have made: the
subject must pass, and what the checker derived from everything it read, read afresh (``digest``: a copy's rows
read again past every cache, its window's records of the pushes in doubt), must be what it was at the last
pass. A skip that would have hidden a violation, or inputs that changed unseen, raise ``AssertionError``.
"""

from __future__ import annotations

from collections.abc import Hashable
from operator import is_
from typing import Any

__all__ = ["Passed"]


class Passed:
    verify = False  # check every subject and assert that each skip would have been right (tests only)

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[tuple[Any, ...], tuple[Any, ...], Any]] = {}
        self._would_skip: set[Hashable] = set()

    def again(self, subject: Hashable, objects: tuple[Any, ...], values: tuple[Any, ...]) -> bool:
        """Whether ``subject`` passed last with the very same ``objects`` and equal ``values``."""
        prev = self._seen.get(subject)
        same = (prev is not None and len(prev[0]) == len(objects)
                and all(map(is_, prev[0], objects))
                and prev[1] == values)
        if not self.verify:
            return same
        if same:
            self._would_skip.add(subject)
        return False

    def passed(self, subject: Hashable, objects: tuple[Any, ...], values: tuple[Any, ...],
               digest: Any = None) -> None:
        """``subject`` passed with these inputs (``digest``: under ``verify``, what the check derived from them,
        read afresh; compared by ``==`` at the next pass the memo would have skipped)."""
        if subject in self._would_skip and self._seen[subject][2] != digest:
            raise AssertionError(f"a checker would have skipped {subject!r} as unchanged, yet what it reads changed")
        self._seen[subject] = (objects, values, digest)
        self._would_skip.discard(subject)

    def failed(self, subject: Hashable, violation: str) -> None:
        """``subject`` did not pass (under ``verify``: it must not have been one ``again`` would have skipped)."""
        self._seen.pop(subject, None)
        if subject in self._would_skip:
            raise AssertionError(f"a checker skipped {subject!r} as unchanged, yet it fails now: {violation}")
