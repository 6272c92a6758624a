"""Preemption: SIGTERM asks a training run to stop at the next step boundary, checkpoint there, and exit.

Schedulers preempt with SIGTERM, and then SIGKILL after a grace period: SLURM with ``--signal=B:SIGTERM@120``
(the batch script forwards it to the trainers), Kubernetes on pod deletion, torchrun when its agent stops.
The handler only sets a flag. The training loop shares it with every rank in the all-reduce it already does
at each step, so all ranks stop after the same step, write one checkpoint (``--checkpoint-dir``) and return
a result with ``"preempted": true``. ``tigana train`` then exits with ``EXIT_PREEMPTED``, so a batch script
can tell a preempted run (requeue it; ``--resume`` continues from that checkpoint) from a failed one.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["EXIT_PREEMPTED", "install", "request", "requested", "reset"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a temporary failure, to be retried

_requested = threading.Event()


def _on_signal(signum: int, _frame: object) -> None:
    _requested.set()


def install() -> bool:
    """Make SIGTERM request a stop at the next step (main thread only; returns whether it was installed)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_signal)
    return True


def request() -> None:
    """Ask for a stop as SIGTERM would (a parent forwarding it, a test)."""
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def reset() -> None:
    _requested.clear()
