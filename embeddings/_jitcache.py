"""Numba's on-disk kernel cache, keyed by every kernel source of Tigana at once.

Numba keys a cached kernel by the hash of the one file the kernel is written in. A kernel's compiled code also
holds what it calls in *other* files (``mix64_scalar`` is inlined into every grouping and hashing kernel) and
the module constants it reads from them. Change one of those and numba still loads the old machine code: the
process runs kernels that no longer match their source, with no error. (A client here kept grouping ids with
a stale kernel after an edit, and a test lost updates until the cache files were deleted.)

``install()`` puts locators in front of numba's own for Tigana's files only. They keep numba's cache places
(beside the source, else the user-wide cache, or ``NUMBA_CACHE_DIR`` when set) and add to the stamp one
digest of every file in ``KERNEL_SOURCES``: any change to any of them recompiles every kernel once.
``tests/embeddings/test_jitcache.py`` checks that the list names every file of the tree that compiles kernels.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

__all__ = ["KERNEL_SOURCES", "install", "kernel_digest"]

# The package root: ``tigana/`` when installed, the repository root in an editable install.
_ROOT = Path(__file__).resolve().parents[1]

# Every file that compiles numba kernels or holds what they inline (paths from the package root).
KERNEL_SOURCES = (
    "embeddings/mixing.py",
    "embeddings/_kernels.py",
    "embeddings/_part_kernels.py",
    "embeddings/_init_kernels.py",
    "embeddings/_checksum.py",
    "ps/_kernels.py",
    "trainer/_kernels.py",
    "tools/testing/sim/kernels.py",
)


def _stamps() -> tuple[tuple[str, int, int], ...]:
    out = []
    for rel in KERNEL_SOURCES:
        try:
            st = (_ROOT / rel).stat()
        except OSError:  # a file missing from this install cannot be stale either
            continue
        out.append((rel, st.st_mtime_ns, st.st_size))
    return tuple(out)


@lru_cache(maxsize=8)
def _digest_of(stamps: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for rel, _, _ in stamps:
        h.update(rel.encode())
        h.update((_ROOT / rel).read_bytes())
    return h.hexdigest()


def kernel_digest() -> str:
    """The sha256 of every kernel source, re-read when one of them changes on disk."""
    return _digest_of(_stamps())


def _ours(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(_ROOT)
    except OSError:
        return False


def _salted(base: type) -> type:
    class Salted(base):  # type: ignore[misc, valid-type]
        def get_source_stamp(self):  # noqa: ANN202 - numba's signature
            return (super().get_source_stamp(), kernel_digest())

        @classmethod
        def from_function(cls, py_func, py_file):  # noqa: ANN206 - numba's signature
            if not _ours(py_file):
                return None  # another library's kernels keep numba's own locators
            return super().from_function(py_func, py_file)

    Salted.__name__ = Salted.__qualname__ = f"Tigana{base.__name__}"
    return Salted


_installed = False


def install() -> None:
    """Put the salted locators first in numba's list (once per process; before any kernel is decorated)."""
    global _installed
    if _installed:
        return
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - the numpy fallbacks cache nothing
        return
    bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator]
    caching.CacheImpl._locator_classes[:0] = [_salted(b) for b in bases]
    _installed = True
