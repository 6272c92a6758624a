"""Numba's disk cache is keyed by every kernel source at once (``tigana.embeddings._jitcache``).

Numba alone keys a cached kernel by its own file: a kernel that inlines ``mix64_scalar`` kept the old machine
code after ``mixing.py`` changed. These tests hold the list of kernel sources complete and show that the stamp
of a kernel in one file changes when another kernel source changes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")

from tigana.embeddings import _jitcache  # noqa: E402
from tigana.embeddings import _kernels as engine_kernels  # noqa: E402
from tigana.ps import _kernels as ps_kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_JIT = re.compile(r"\bnjit\b")


def test_the_list_names_every_file_that_compiles_kernels() -> None:
    found = set()
    for folder in ("embeddings", "ps", "trainer", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "_jitcache.py":
                continue
            text = path.read_text()
            if "cache=True" in text and _JIT.search(text):
                found.add(path.relative_to(REPO).as_posix())
    found.discard("tools/warm_cache.py")  # it names kernels in its docstring and compiles none
    assert found <= set(_jitcache.KERNEL_SOURCES), found - set(_jitcache.KERNEL_SOURCES)
    for rel in _jitcache.KERNEL_SOURCES:
        assert (REPO / rel).is_file(), rel


def test_tigana_kernels_use_the_salted_locator_and_others_do_not(tmp_path: Path) -> None:
    for kernel in (ps_kernels.dedup_sum_grouped, next(_compiled(engine_kernels))):
        locator = kernel._cache._impl.locator
        assert type(locator).__name__.startswith("Tigana"), type(locator)
        assert locator.get_source_stamp()[1] == _jitcache.kernel_digest()
    foreign = tmp_path / "foreign_kernels.py"
    foreign.write_text("def f(x):\n    return x + 1\n")
    from numba.core import caching

    namespace: dict = {}
    exec(compile(foreign.read_text(), str(foreign), "exec"), namespace)
    impl = caching.CompileResultCacheImpl(namespace["f"])
    assert not type(impl.locator).__name__.startswith("Tigana")


def test_a_change_to_another_kernel_source_changes_every_stamp(tmp_path: Path, monkeypatch) -> None:
    sources = []
    for i in range(2):
        path = tmp_path / f"k{i}.py"
        path.write_text(f"# kernel source {i}\n")
        sources.append(path.name)
    monkeypatch.setattr(_jitcache, "_ROOT", tmp_path)
    monkeypatch.setattr(_jitcache, "KERNEL_SOURCES", tuple(sources))
    before = _jitcache.kernel_digest()
    (tmp_path / "k1.py").write_text("# kernel source 1, edited: a longer line\n")
    after = _jitcache.kernel_digest()
    assert before != after
    assert _jitcache.kernel_digest() == after  # stable while nothing changes


def _compiled(module):
    from numba.core.registry import CPUDispatcher

    for value in vars(module).values():
        if isinstance(value, CPUDispatcher) and value._cache is not None and hasattr(value._cache, "_impl"):
            yield value
