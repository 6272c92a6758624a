"""TableLock: a plain mutex for the data path; background work (``yielding``) goes after data-path callers that
wait for it, and is held back at most ``max_wait_s``."""

from __future__ import annotations

import threading
import time

import pytest

from tigana.ps.shard.tablelock import TableLock


def _wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_it_is_a_mutex_and_an_uncontended_caller_is_never_counted() -> None:
    lock = TableLock()
    with lock:
        assert lock.locked() and lock.waiting == 0
        assert not lock.acquire(blocking=False)
        t = time.monotonic()
        assert not lock.acquire(timeout=0.05)
        assert time.monotonic() - t >= 0.04 and lock.waiting == 0
    assert not lock.locked()
    with lock.yielding():
        assert lock.locked()
    assert lock.acquire(blocking=False)
    lock.release()


@pytest.mark.parametrize("round_", range(5))
def test_background_work_goes_after_the_data_path_callers_waiting(round_: int) -> None:
    """The lock is held; a data-path caller waits for it, then background work asks for it: when the lock is
    released, the data path enters first (a plain Lock lets either win)."""
    lock = TableLock()
    order: list[str] = []
    lock.acquire()

    def data_path() -> None:
        with lock:
            order.append("push")
            time.sleep(0.01)

    def background() -> None:
        with lock.yielding(max_wait_s=10):
            order.append("copy")

    a = threading.Thread(target=data_path)
    a.start()
    _wait_until(lambda: lock.waiting == 1)
    b = threading.Thread(target=background)
    b.start()
    time.sleep(0.02)  # the background caller is waiting too
    assert order == []
    lock.release()
    a.join(5)
    b.join(5)
    assert order == ["push", "copy"] and lock.waiting == 0 and not lock.locked()


def test_background_work_is_held_back_at_most_max_wait() -> None:
    """A data-path caller counted as waiting that does not take the lock (white-box: the count set by hand, the
    lock free) holds background work back ``max_wait_s``, not longer."""
    lock = TableLock()
    lock._waiting = 1
    t = time.monotonic()
    with lock.yielding(max_wait_s=0.05):
        waited = time.monotonic() - t
    assert 0.04 <= waited < 1.0
    lock._waiting = 0
    t = time.monotonic()
    with lock.yielding(max_wait_s=5):
        assert time.monotonic() - t < 0.5  # nobody waits: at once
