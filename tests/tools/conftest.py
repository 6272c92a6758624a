"""Fixtures of the command-line and benchmark tests."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest


@pytest.fixture
def bench_lines(capsys) -> Callable[[], list[dict]]:
    """``bench_lines()``: the JSON lines a benchmark printed to stdout since the last call (one per case)."""
    def read() -> list[dict]:
        return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return read
