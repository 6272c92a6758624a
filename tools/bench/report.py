"""One JSON line per benchmark case: the figure, the peer (or limit) measured in the same run, the ratio."""

from __future__ import annotations

import json
import sys
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


def log(msg: str) -> None:
    """Progress for humans goes to stderr; stdout carries only the JSON lines."""
    print(msg, file=sys.stderr, flush=True)


def parse_counts(text: str) -> list[int]:
    """"1M,10M,20M" or "100k, 2_000_000" -> [1000000, 10000000, 20000000]; suffixes k, M, B."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower().replace("_", "")
        if not part:
            continue
        scale = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000}.get(part[-1], 1)
        out.append(int(float(part[:-1] if scale > 1 else part) * scale))
    return out
