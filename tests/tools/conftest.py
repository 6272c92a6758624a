"""Fixtures of the command-line and benchmark tests."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

# The k8s tests' shared checks assert too: rewritten like a test module's, so a failure shows its values.
pytest.register_assert_rewrite("k8s_checks", "k8s_manifests")


@pytest.fixture
def bench_lines(capsys) -> Callable[[], list[dict]]:
    """``bench_lines()``: the JSON lines a benchmark printed to stdout since the last call (one per case)."""
    def read() -> list[dict]:
        return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return read
