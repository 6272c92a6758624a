"""glibc's allocator tuned for large message buffers, in this process (``tune_allocator``) or a child
(``ALLOCATOR_ENV``). Shared by the servers, the client and the trainer; imports nothing of ours."""

from __future__ import annotations

import ctypes

# The same large-buffer settings for a child process, through glibc's environment tunables.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
                 "MALLOC_TOP_PAD_": str(64 << 20)}
SERVER_ARENAS = 1  # a shard daemon's malloc arenas (``tune_allocator``'s arena_max)


def tune_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20,
                   top_pad: int | None = None, arena_max: int | None = None) -> bool:
    """Make glibc serve multi-MiB message buffers from the heap instead of a fresh mmap (and page faults) per
    message: large gRPC payloads move several times faster. Costs resident memory that is kept for reuse.
    ``top_pad``: extra bytes the heap grows by at a time (unchanged when None). ``arena_max``: at most this
    many malloc arenas (unchanged when None; glibc's default is 8 per core): every arena keeps its own freed
    message buffers, so a shard daemon's handler threads held RSS of 24 bytes per resident row beyond the
    engine's at 20 M rows with the default, 10 with one arena, at the same pull, push and insert rates
    (``bench ps --inserts``, ``bench ps --dims 64``). Process-wide; call
    once at start, before threads allocate (``tigana server`` does). Returns False where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8  # from <malloc.h>
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
        ok = ok and libc.mallopt(m_trim_threshold, int(trim_threshold)) == 1
        ok = ok and (arena_max is None or libc.mallopt(m_arena_max, int(arena_max)) == 1)
        return ok and (top_pad is None or libc.mallopt(m_top_pad, int(top_pad)) == 1)
    except (OSError, AttributeError):
        return False


def release_free_memory() -> bool:
    """Give the free pages inside the heap back to the kernel (glibc's ``malloc_trim(0)``): the trim threshold
    only returns free memory at the heap's top, and message buffers freed in the middle stayed resident: a
    shard daemon held about 9 bytes per resident row at 20 M rows (175 MiB) that this returns. A few
    milliseconds; the shard daemon calls it every ``TRIM_EVERY_S``. False where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


TRIM_EVERY_S = 10.0  # how often a shard daemon calls ``release_free_memory``
# under a memory budget: freed temporaries (a spill's records, the spilled ids' index partitions a growth
# replaced) sat in the heap between trims; at 10 s a 1 GiB daemon's median RSS stood 1.18x its budget, 1.07x at 1 s
BUDGET_TRIM_EVERY_S = 1.0

