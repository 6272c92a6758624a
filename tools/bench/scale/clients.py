"""The client processes of ``bench scale``: each its own ``ps.Client`` in its own process, driven by JSON
requests on its stdin (prepare a point, run a timed repeat, release it), one JSON reply line each."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import traceback

import numpy as np

from tigana import ps
from tigana.ps.ops.local import stop_process
from tigana.tools.bench.ps.workload import zipf_batches
from tigana.tools.bench.scale.resources import _self_cpu_s
from tigana.tools.bench.scale.workload import TABLE, _create_table


def _die_with_parent() -> None:  # a crashed benchmark leaves no client processes behind
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main() -> int:
    """A client process: JSON requests on stdin, one JSON reply line each on stdout (nothing else goes there)."""
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the death signal was armed
        return 0
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    points: dict[str, dict] = {}
    try:
        for line in sys.stdin.buffer:
            msg = json.loads(line)
            try:
                reply = _worker_op(points, msg)
            except Exception as exc:  # reported to the coordinator, which raises it
                reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
    finally:
        for p in points.values():
            with contextlib.suppress(Exception):
                p["client"].close()
    return 0


def _worker_op(points: dict[str, dict], msg: dict) -> dict:
    op = msg["op"]
    if op == "prepare":
        client = ps.connect(msg["addresses"])
        client.wait_ready(60)
        _create_table(client, msg["dim"])
        batches = zipf_batches(msg["count"], msg["batch"], msg["num_ids"], msg["zipf"], seed=msg["seed"])
        rng = np.random.default_rng(msg["seed"] + 1)
        grads = [rng.normal(0, 0.01, (msg["batch"], msg["dim"])).astype(np.float32) for _ in range(2)]
        points[msg["key"]] = {"client": client, "batches": batches, "grads": grads, "i": 0}
        return {"unique_ids": float(np.mean([np.unique(b).size for b in batches]))}
    if op == "run":
        p = points[msg["key"]]
        client, batches, grads, kind = p["client"], p["batches"], p["grads"], msg["kind"]
        rows, cpu0 = 0, _self_cpu_s()
        for _ in range(msg["batches"]):
            p["i"] += 1
            b, g = batches[p["i"] % len(batches)], grads[p["i"] % len(grads)]
            if kind in ("pull", "step"):
                client.pull(TABLE, b)
            if kind in ("push", "step"):
                client.push(TABLE, b, g)
            rows += b.size
        if kind != "pull":
            client.flush()
        return {"rows": rows, "cpu_s": _self_cpu_s() - cpu0}
    if op == "release":
        p = points.pop(msg["key"], None)
        if p is not None:
            p["client"].close()
        return {}
    raise ValueError(f"unknown op {op!r}")


class _Worker:
    """One client process (``python -m tigana.tools.bench.scale --worker``) and its request/reply pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tigana.tools.bench.scale", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid

    def send(self, **msg) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = 900.0) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            code = self.proc.poll()
            raise RuntimeError(f"bench scale: client process {self.pid} "
                               + ("did not answer in time" if code is None else f"exited with code {code}"))
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench scale: client process {self.pid}: {reply['error']}\n{reply['traceback']}")
        return reply

    def call(self, **msg) -> dict:
        self.send(**msg)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the worker's loop ends at EOF and closes its clients
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
