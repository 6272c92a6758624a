"""tools/k8s/Dockerfile: a pinned base, dependencies in layers before the source, a server image without torch,
tini as PID 1, and the numba cache warmed at build time (whose step, ``tigana.tools.warm_cache``, runs here).

No Docker daemon is needed: the file is parsed, and the commands that decide what gets installed (the
requirement one-liners) run against the real pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

from tigana.trainer.extra import TRAIN_EXTRA

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "tools" / "k8s"


def _steps() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM excluded); the ARGs before the first FROM under ''."""
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for instruction, args in _steps():
        if instruction == "FROM":
            base, _, name = args.partition(" AS ")
            current = name.strip()
            stages[current] = [("FROM", base.strip())]
            continue
        stages[current].append((instruction, args))
    return stages


def _args(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in stage if i == "ARG" and "=" in a)


def _one_liner(run: str, *extra: str) -> list[str]:
    """Run a stage's `python -c '...' ARGS > FILE` requirement one-liner against the real pyproject.toml."""
    m = re.search(r"python -c '([^']+)'\s*([^>]*)>", run)
    assert m, run
    out = subprocess.run([sys.executable, "-c", m.group(1), *m.group(2).split(), *extra], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[;! ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_base_image_is_pinned_to_a_patch_release() -> None:
    image = _args(_stages()[""])["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    assert _stages()["deps-server"][0] == ("FROM", "${PYTHON_IMAGE}")


def test_dependencies_install_before_the_source_is_copied() -> None:
    stages = _stages()
    for name in ("deps-server", "deps-train"):
        copies = [a for i, a in stages[name] if i == "COPY"]
        assert all(c.split()[0] in ("pyproject.toml", "tools/torch_wheel.py") for c in copies), (name, copies)
    image = stages["image"]
    assert image[0] == ("FROM", "deps-${FLAVOR}")
    copied = {source for i, a in image if i == "COPY" for source in a.split()[:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {d.split("/")[0] for d in project["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= copied, needed - copied
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    for source in needed:
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is excluded from the build context"
    # the package itself adds nothing: its dependencies are in the layers below
    assert any("pip install --no-deps ." in a for i, a in image if i == "RUN")


def test_the_server_image_has_no_torch_and_the_default_image_has_the_train_extra() -> None:
    stages = _stages()
    assert _args(stages[""])["FLAVOR"] == "train"  # the default build is the full image
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (server_run,) = [a for i, a in stages["deps-server"] if i == "RUN" and "requirements.txt" in a]
    server = _one_liner(server_run)
    assert server == project["dependencies"] + project["optional-dependencies"]["etcd"]
    assert not _names(server) & TRAIN_EXTRA
    (train_run,) = [a for i, a in stages["deps-train"] if i == "RUN"]
    assert _names(_one_liner(train_run)) == TRAIN_EXTRA
    # torch comes first, from the CPU index when it answers, with the Makefile's pin
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_PIN \?= (\S+)$", makefile, re.M).group(1)
    index = re.search(r"^TORCH_INDEX \?= (\S+)$", makefile, re.M).group(1)
    assert _args(stages["deps-train"]) == {"TORCH_PIN": pin, "TORCH_INDEX": index}
    assert train_run.startswith('python /tmp/torch_wheel.py --pin "$TORCH_PIN" --index "$TORCH_INDEX"')


def test_tini_is_pid_1_and_the_image_runs_as_its_user() -> None:
    stages = _stages()
    assert any("apt-get install -y --no-install-recommends tini" in a for i, a in stages["deps-server"] if i == "RUN")
    image = stages["image"]
    assert [json.loads(a) for i, a in image if i == "ENTRYPOINT"] == [["tini", "--", "tigana"]]
    assert [a for i, a in image if i == "USER"] == ["10001:10001"]
    assert [json.loads(a) for i, a in image if i == "VOLUME"] == [["/data"]]
    assert {7100, 7200, 9200} <= {int(p) for i, a in image if i == "EXPOSE" for p in a.split()}


def test_the_numba_cache_is_warmed_at_build_time_as_the_user() -> None:
    stages = _stages()
    env = " ".join(a for i, a in stages["deps-server"] if i == "ENV")
    cache = re.search(r"NUMBA_CACHE_DIR=(\S+)", env).group(1)
    assert any(cache in a and "chown 10001:10001" in a for i, a in stages["deps-server"] if i == "RUN")
    image = stages["image"]
    order = [(i, a) for i, a in image if i in ("USER", "RUN")]
    assert order[-1] == ("RUN", "python -m tigana.tools.warm_cache")
    assert order[-2] == ("USER", "10001:10001")


def test_warm_cache_fills_the_cache_a_second_process_loads(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-m", "tigana.tools.warm_cache"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.splitlines()[-1])["numba_cache_dir"] == str(tmp_path / "cache")
    compiled = sorted(p.name for p in (tmp_path / "cache").rglob("*.nbc"))
    assert len(compiled) >= 10, compiled  # the engine's and the data path's kernels
    second = subprocess.run([sys.executable, "-m", "tigana.tools.warm_cache"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    # everything came from the cache: nothing new was compiled
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.nbc")) == compiled
