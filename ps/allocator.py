"""glibc's allocator tuned for large message buffers, in this process (``tune_allocator``) or a child
(``ALLOCATOR_ENV``). Shared by the servers, the client and the trainer; imports nothing of ours."""

from __future__ import annotations

import ctypes

# The same large-buffer settings for a child process, through glibc's environment tunables.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
                 "MALLOC_TOP_PAD_": str(64 << 20)}


def tune_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20,
                   top_pad: int | None = None) -> bool:
    """Make glibc serve multi-MiB message buffers from the heap instead of a fresh mmap (and page faults) per
    message: large gRPC payloads move several times faster. Costs resident memory that is kept for reuse.
    ``top_pad``: extra bytes the heap grows by at a time (unchanged when None). Process-wide; call once at
    start (``tigana server`` does). Returns False where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # from <malloc.h>
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
        ok = ok and libc.mallopt(m_trim_threshold, int(trim_threshold)) == 1
        return ok and (top_pad is None or libc.mallopt(m_top_pad, int(top_pad)) == 1)
    except (OSError, AttributeError):
        return False
