"""The Redis peer of ``bench ps``: a throw-away ``redis-server`` and the cases run against it (pipelined
MGET/MSET of the unique ids' rows as packed bytes)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

import numpy as np

from tigana.ps.ops.local import free_port, stop_process
from tigana.tools.bench.ps.workload import _Cycle
from tigana.tools.bench.report import log


class RedisPeer:
    """A throw-away ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, binary: str, attempts: int = 3) -> None:
        import redis

        # The free port can be taken between our probe and redis' bind, and redis then exits at once: retry on
        # a new port. `setpriv --pdeathsig` makes redis die with the benchmark without a preexec_fn (Python code
        # between fork and exec in a multi-threaded gRPC process can hang or crash the child).
        wrapper = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        for attempt in range(1, attempts + 1):
            self.port = free_port()
            with tempfile.TemporaryFile() as output:  # redis logs to stdout; read only when it fails to start
                self.proc = subprocess.Popen([*wrapper, binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                              "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                              "--loglevel", "warning"],
                                             stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if self._started(redis):
                    return
                self.close()
                output.seek(0)
                why = output.read().decode(errors="replace")[-500:].strip()
            if attempt == attempts:
                raise RuntimeError(f"redis-server did not start on port {self.port} (exit {self.proc.returncode}): "
                                   f"{why}")
            log(f"bench ps: redis-server did not start on port {self.port}; trying another port")

    def _started(self, redis) -> bool:
        """Wait until our server answers PING (True), or it exits, or 30 s pass (False). A short-timeout probe
        client: something else listening on the port must not hang the wait."""
        self.db = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 30
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0)) as probe:
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    probe.ping()
                    return self.proc.poll() is None
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        return False

    def mget(self, keys: list[int], step: int = 1024) -> list[bytes]:
        pipe = self.db.pipeline(transaction=False)
        for i in range(0, len(keys), step):
            pipe.mget(keys[i:i + step])
        out: list[bytes] = []
        for part in pipe.execute():
            out.extend(part)
        return out

    def mset(self, keys: list[int], values: list[bytes], step: int = 1024) -> None:
        pipe = self.db.pipeline(transaction=False)
        for i in range(0, len(keys), step):
            pipe.mset(dict(zip(keys[i:i + step], values[i:i + step], strict=True)))
        pipe.execute()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.db.close()
        stop_process(self.proc)


def _rows_as_values(rows: np.ndarray, codec: str) -> list[bytes]:
    block = rows.astype("<f2") if codec == "fp16" else np.ascontiguousarray(rows, "<f4")
    return block.view(np.dtype((np.void, block.shape[1] * block.itemsize))).ravel().tolist()


def _values_as_rows(values: list[bytes], dim: int, codec: str) -> np.ndarray:
    dtype = "<f2" if codec == "fp16" else "<f4"
    return np.frombuffer(b"".join(values), dtype).astype(np.float32).reshape(-1, dim)


def _redis_cases(peer: RedisPeer, uniques: list, dim: int, codec: str,
                 n: int) -> dict[str, tuple[str, Callable[[], int]]]:
    """Redis versions of the cases over the unique ids of each batch, rows stored as packed bytes."""
    peer.db.flushall()
    rng = np.random.default_rng(2)
    keys = [u.tolist() for u, _ in uniques]
    rows = [rng.normal(0, 0.01, (len(u), dim)).astype(np.float32) for u, _ in uniques]
    for k, r in zip(keys, rows, strict=True):
        peer.mset(k, _rows_as_values(r, codec))
    which = _Cycle(list(range(len(uniques))))

    def mget() -> int:
        i = which()
        got = _values_as_rows(peer.mget(keys[i]), dim, codec)
        got[uniques[i][1]]  # back to batch order, as the client does
        return n

    def mset() -> int:
        i = which()
        peer.mset(keys[i], _rows_as_values(rows[i], codec))
        return n

    def both() -> int:
        mget()
        return mset()

    return {"pull": ("redis MGET", mget), "push": ("redis MSET", mset), "step": ("redis MGET+MSET", both)}
