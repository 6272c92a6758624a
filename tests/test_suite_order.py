"""The suite's schedule (tests/suite_order.py): every file ``HEAVIEST_FIRST`` names exists (a renamed one would
silently drop to the end of the run), the collection puts them first in that order, and ``make test`` keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_order import HEAVIEST_FIRST

HERE = Path(__file__).parent


def test_every_heavy_file_exists_once() -> None:
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)
    missing = [name for name in HEAVIEST_FIRST if not (HERE / name).is_file()]
    assert not missing, f"HEAVIEST_FIRST names files that are not there: {missing}"


def test_the_collection_starts_with_the_heavy_files_in_order(request: pytest.FixtureRequest) -> None:
    files = list(dict.fromkeys(str(Path(item.path).relative_to(HERE)) for item in request.session.items))
    collected = [name for name in HEAVIEST_FIRST if name in files]  # a run of a part of the suite has fewer
    assert files[:len(collected)] == collected


def test_make_test_hands_files_out_in_collection_order() -> None:
    assert "--dist loadfile --no-loadscope-reorder" in (HERE.parent / "Makefile").read_text()
