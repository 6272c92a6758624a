"""tools/torch_wheel.py: the CPU index when it answers, the registry otherwise (as on machines that reach only
the registry), nothing when the pinned torch is already there. A real HTTP server plays the index."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tigana.tools import torch_wheel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """A PEP 503 index with a torch page, served over HTTP on a loopback port."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html><body></body></html>")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reachable_index_is_probed_over_http(index: str) -> None:
    assert torch_wheel.reachable(index, timeout=5)
    assert not torch_wheel.reachable(f"http://127.0.0.1:{_closed_port()}", timeout=2)
    assert not torch_wheel.reachable(index + "/missing", timeout=5)  # a 404 is not an index with torch
    assert not torch_wheel.reachable("not a url", timeout=1)


def test_plan_prefers_the_index_then_falls_back_to_the_registry() -> None:
    pin = "torch==2.13.0"
    cpu = torch_wheel.CPU_INDEX
    assert torch_wheel.plan(pin, cpu, is_reachable=True, already=False) == [
        ["install", pin, "--index-url", cpu], ["install", pin]]
    assert torch_wheel.plan(pin, cpu, is_reachable=False, already=False) == [["install", pin]]
    assert torch_wheel.plan(pin, torch_wheel.REGISTRY, is_reachable=True, already=False) == [["install", pin]]
    assert torch_wheel.plan(pin, cpu, is_reachable=True, already=True) == []


def test_installed_ignores_the_local_label() -> None:
    import torch

    base = torch.__version__.split("+", 1)[0]
    assert torch_wheel.installed(f"torch=={base}")
    assert not torch_wheel.installed("torch==0.0.1")
    assert not torch_wheel.installed(f"torch>={base}")  # only == pins are decided here; pip decides the rest


def _dry_run(*args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "torch_wheel.py"), "--dry-run", *args],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stderr


def test_script_picks_the_reachable_index(index: str) -> None:
    # a pin this environment lacks, so the script has to decide
    err = _dry_run("--pin", "torch==0.0.1", "--index", index)
    assert f"pip install torch==0.0.1 --index-url {index}" in err


def test_script_falls_back_to_the_registry_when_the_index_is_unreachable() -> None:
    err = _dry_run("--pin", "torch==0.0.1", "--index", f"http://127.0.0.1:{_closed_port()}", "--timeout", "2")
    assert "is not reachable" in err and "TORCH_INDEX" in err
    assert err.strip().endswith("pip install torch==0.0.1")


def test_script_does_nothing_when_torch_is_there() -> None:
    import torch

    err = _dry_run("--pin", f"torch=={torch.__version__.split('+', 1)[0]}", "--timeout", "1")
    assert "already installed" in err


def test_makefile_installs_torch_through_the_script_and_everything_with_it() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "tools/torch_wheel.py --pin \"$(TORCH_PIN)\" --index \"$(TORCH_INDEX)\"" in makefile
    assert '".[dev,train]"' in makefile
