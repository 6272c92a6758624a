"""``python -m tigana.tools.warm_cache``: compile every numba kernel once, into ``NUMBA_CACHE_DIR``.

The storage engine's and the data path's kernels are ``@njit(cache=True)``: compiled on first use (a cold
process spends about 3 s in the JIT before its first pull) and loaded from the cache afterwards. An image runs
this at build time, as the user its daemons run as, so that no pod pays the JIT.

It starts a shard server in this process on a loopback port, creates a table per optimizer and storage type,
pushes and pulls through the client (every wire compression), snapshots, restores, and stops. Prints one JSON
line: the seconds it took and the cache folder. Exits 1 when a step fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tigana import ps


def warm(data_dir: Path) -> None:
    """Run every kernel's path once through a real server and client. Blocking; raises on failure."""
    handle = ps.start_server(ps.ServerConfig(host="127.0.0.1", port=0, data_dir=str(data_dir)))
    try:
        if not handle.wait_ready(120):
            raise RuntimeError("the warm-up server did not become ready within 120 s")
        optimizers = [ps.SGD(lr=0.1), ps.Adagrad(lr=0.1), ps.RowWiseAdagrad(lr=0.1), ps.Adam(lr=0.01),
                      ps.FTRL(alpha=0.1)]
        rng = np.random.default_rng(0)
        ids = rng.integers(-(2**62), 2**62, size=512, dtype=np.int64)
        ids = np.concatenate([ids, ids[:64]])  # duplicates: the dedup kernels
        with ps.connect([handle.address]) as client:
            for i, optimizer in enumerate(optimizers):
                for compression in ("none", "fp16", "bf16", "int8"):
                    name = f"warm_{i}_{compression}"
                    client.create_table(name, dim=8, optimizer=optimizer, initializer=ps.Normal(std=0.01),
                                        compression=compression)
                    client.pull(name, ids)
                    client.push(name, ids, rng.normal(size=(ids.size, 8)).astype(np.float32)).result()
                    client.pull(name, ids)
            client.flush()
            client.snapshot()
    finally:
        handle.close()


def main() -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tigana-warm-") as tmp:
        try:
            warm(Path(tmp))
        except Exception as exc:  # any failure fails the build step, with its reason
            print(f"warm_cache: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print(json.dumps({"warm_cache_s": round(time.perf_counter() - started, 2),
                      "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR", "(next to the modules)")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
