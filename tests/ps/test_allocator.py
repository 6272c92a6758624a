"""``tigana.ps.allocator``: glibc accepts every setting a shard daemon asks for (its large-buffer thresholds
and one malloc arena), in a fresh process as ``tigana server`` makes them."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_settings_are_accepted_by_glibc() -> None:
    code = ("from tigana.ps.allocator import SERVER_ARENAS, tune_allocator\n"
            "assert SERVER_ARENAS == 1\n"
            "print(tune_allocator(arena_max=SERVER_ARENAS), tune_allocator(top_pad=64 << 20))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_release_free_memory_returns_freed_heap_pages() -> None:
    """Buffers under the mmap threshold live in the heap; freed in its middle they stay resident until
    ``release_free_memory``. Measured in a fresh process on its own RSS."""
    code = ("import numpy as np\n"
            "from tigana.ps.allocator import release_free_memory, tune_allocator\n"
            "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
            "tune_allocator()\n"
            "keep, free = [], []\n"
            "for i in range(64):  # 4 MiB buffers, every other one kept: the freed ones are holes, not the top\n"
            "    (keep if i % 2 else free).append(np.ones(1 << 19))\n"
            "del free\n"
            "before = rss()\n"
            "assert release_free_memory()\n"
            "print(before - rss())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout) > 100 << 20, out.stdout  # most of the 128 MiB freed comes back
