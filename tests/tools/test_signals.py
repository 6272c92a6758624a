"""``StopSignal``: a daemon's main thread stops on SIGTERM whichever thread the kernel delivered it to."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from tigana.tools.signals import StopSignal

    stop = StopSignal()

    def worker():
        time.sleep(0.3)
        # the signal handled in this thread, as the kernel may choose: the main thread is blocked in wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        time.sleep(30)

    threading.Thread(target=worker, daemon=True).start()
    started = time.monotonic()
    stop.wait()
    print(stop.name, round(time.monotonic() - started, 2), flush=True)
""")


def test_a_sigterm_delivered_to_another_thread_wakes_the_main_thread() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0, out.stderr
    name, seconds = out.stdout.split()
    assert name == "SIGTERM" and float(seconds) < 5.0  # a plain Event.wait() slept until killed


def test_wait_with_a_timeout_and_set_from_code() -> None:
    from tigana.tools.signals import StopSignal

    stop = StopSignal()
    try:
        assert stop.wait(0.05) is False and not stop.is_set()
        stop.set()
        assert stop.wait() is True and stop.is_set() and stop.name == "stop"
    finally:
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
