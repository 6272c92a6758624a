"""Install the torch build that fits the machine: the CPU wheel where the PyTorch CPU index is reachable,
the package registry's wheel otherwise.

An unqualified ``pip install torch==X`` on Linux x86_64 takes PyPI's CUDA build (several GB of ``nvidia-*``
wheels). The CPU wheel lives on PyTorch's own index, which some machines cannot reach (only a registry
mirror is): there set-up must still work, so we fall back to the registry, saying what that costs.

Standard library only, no ``tigana`` import: the Makefile and the Dockerfile run it as a file
(``python tools/torch_wheel.py``) before the package is installed.

    python tools/torch_wheel.py --pin torch==2.13.0                          # CPU index, else the registry
    python tools/torch_wheel.py --pin torch==2.13.0 --index https://download.pytorch.org/whl/cu128  # a GPU
    python tools/torch_wheel.py --pin torch==2.13.0 --index registry         # the registry's default build
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import urllib.error
import urllib.request
from importlib import metadata

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REGISTRY = "registry"  # --index value: no --index-url, i.e. pip's own configuration (PIP_INDEX_URL, pip.conf)


def reachable(index: str, timeout: float = 5.0) -> bool:
    """Whether ``index`` (a PEP 503 simple index) answers for the ``torch`` project within ``timeout`` s.

    Blocking; never raises: any network or HTTP error is an unreachable index.
    """
    url = index.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (an http(s) URL we build)
            return 200 <= response.status < 300
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors; ValueError: a malformed URL
        return False


def installed(pin: str) -> bool:
    """Whether the running interpreter already has the torch that ``pin`` (``torch==X``) names.

    A local label (``2.13.0+cpu``) satisfies ``==2.13.0``, as in PEP 440. Pins other than ``torch==X`` are
    never considered satisfied (pip decides).
    """
    name, sep, wanted = pin.partition("==")
    if not sep or name.strip().lower() != "torch":
        return False
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    return have.split("+", 1)[0] == wanted.strip()


def plan(pin: str, index: str, *, is_reachable: bool, already: bool) -> list[list[str]]:
    """The pip argument lists to try in order (the first that succeeds wins); empty when nothing to do.

    ``index`` is a URL, or ``registry`` for the registry's default build.
    """
    if already:
        return []
    attempts = []
    if index != REGISTRY and is_reachable:
        attempts.append(["install", pin, "--index-url", index])
    attempts.append(["install", pin])
    return attempts


def install(pin: str, index: str, *, python: str = sys.executable, timeout: float = 5.0,
            dry_run: bool = False) -> int:
    """Install ``pin`` into ``python``'s environment; returns pip's exit code (0 when already there)."""
    already = installed(pin) if python == sys.executable else False
    is_reachable = index != REGISTRY and not already and reachable(index, timeout)
    attempts = plan(pin, index, is_reachable=is_reachable, already=already)
    if not attempts:
        print(f"torch_wheel: {pin} is already installed", file=sys.stderr)
        return 0
    if index != REGISTRY and not is_reachable:
        print(f"torch_wheel: {index} is not reachable; installing {pin} from the package registry "
              "(on Linux x86_64 that is the CUDA build; set TORCH_INDEX to the index you want)", file=sys.stderr)
    rc = 1
    for args in attempts:
        command = [python, "-m", "pip", *args]
        print("torch_wheel: " + " ".join(command[1:]), file=sys.stderr)
        if dry_run:
            return 0
        rc = subprocess.call(command)
        if rc == 0:
            return 0
        print(f"torch_wheel: pip exited {rc}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch_wheel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pin", default="torch==2.13.0", help="the requirement (default: torch==2.13.0)")
    parser.add_argument("--index", default=CPU_INDEX,
                        help=f"the index to prefer, or '{REGISTRY}' for the registry's default build "
                             f"(default: {CPU_INDEX})")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter whose environment gets torch (default: this one)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the index (default: 5)")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)
    return install(args.pin, args.index.strip() or REGISTRY, python=args.python, timeout=args.timeout,
                   dry_run=args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
