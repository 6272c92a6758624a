"""One JSON line per benchmark case: the figure, the peer (or limit) measured in the same run, the ratio."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def emit(case: str, unit: str, value: float, peer: str, peer_value: float | None, **params: Any) -> dict:
    """Print and return one result line. ``ratio`` = value / peer_value (None when there is no peer)."""
    ratio = (value / peer_value) if peer_value else None
    line = {"case": case, "unit": unit, "value": _round(value), "peer": peer,
            "peer_value": _round(peer_value) if peer_value is not None else None,
            "ratio": _round(ratio) if ratio is not None else None, **params}
    print(json.dumps(line), flush=True)
    return line


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def median_rate(fn: Callable[[], int], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median over ``repeats`` of (items returned by fn) / seconds. ``fn`` does one unit of work."""
    for _ in range(warmup):
        fn()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def log(msg: str) -> None:
    """Progress for humans goes to stderr; stdout carries only the JSON lines."""
    print(msg, file=sys.stderr, flush=True)
