"""What ``bench ps`` times and how: batches of Zipf ids, cycled through, and the interleaved timed runs that
let every system see the same machine load."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from tigana.ps import routing


def zipf_batches(count: int, size: int, num_ids: int, a: float, seed: int = 0) -> list[np.ndarray]:
    """``count`` batches of ``size`` int64 ids in [0, num_ids), Zipf(a) by rank (rejection above num_ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = np.empty(0, np.int64)
        while ids.size < size:
            draw = rng.zipf(a, size * 2)
            ids = np.concatenate([ids, draw[draw <= num_ids] - 1])
        # scatter ranks over the id space so hot ids do not share slots
        out.append((routing.mix64(ids[:size]) % np.uint64(num_ids)).astype(np.int64))
    return out


class _Cycle:
    """The items in turn, round and round: each call returns the next one."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def interleaved_rates(fns: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median items/s of each function, their timed runs interleaved (round-robin, rotating the start) so
    that every system sees the same machine load: a shared, busy machine otherwise biases the ratios."""
    names = list(fns)
    for name in names:  # warm-up
        fns[name]()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.perf_counter()
            items = fns[name]()
            rates[name].append(items / (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in rates.items()}
