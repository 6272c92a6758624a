"""The `tigana` console script as a user runs it."""

import subprocess
import sys


def _tigana(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tigana.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_version() -> None:
    out = _tigana("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("tigana ")


def test_help_lists_bench() -> None:
    out = _tigana("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout
