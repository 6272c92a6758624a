"""A torch-free install (``pip install tigana``, without the ``train`` extra) runs a cluster and ``tigana serve``.

The daemons run as real processes in an environment where ``import torch`` (and the other modules of the
``train`` extra) fails as it does when they are not installed: a ``sitecustomize`` first on ``PYTHONPATH``
puts a finder that refuses them first on the import system's path.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tomllib

from tigana import ps
from tigana.ps.serving import ServingClient
from tigana.trainer.config import TrainConfig
from tigana.trainer.extra import TRAIN_EXTRA, needed, require

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "tigana.tools.cli"]


# First on the import system's path: a finder that finds none of the train extra's modules, as in an install
# without them (``import torch`` and ``importlib.util.find_spec("torch")`` both fail, in spawned processes too).
_BLOCKER = """\
import sys


class _TrainExtraIsNotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _TrainExtraIsNotInstalled())
"""


def _env_without(tmp_path: Path, modules: set[str] | frozenset[str]) -> dict[str, str]:
    """This environment, in which ``modules`` (top-level names) cannot be imported or found."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(modules)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    return _env_without(tmp_path, TRAIN_EXTRA)


@contextlib.contextmanager
def _spawn(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _ready(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        if path.exists():
            with contextlib.suppress(ValueError):
                return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(log.read_text()[-3000:])


def test_the_blocker_blocks(no_torch_env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-c", "import torch"], env=no_torch_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "No module named 'torch'" in out.stderr
    out = subprocess.run([sys.executable, "-c", "import numpy, grpc"], env=no_torch_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_torch_is_in_the_train_extra_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]}
    assert not names & TRAIN_EXTRA
    train = {dep.split(">")[0].split("=")[0].strip() for dep in project["optional-dependencies"]["train"]}
    assert train == TRAIN_EXTRA
    assert "tigana[train]" in project["optional-dependencies"]["dev"]


def test_train_without_torch_shows_its_help_and_says_which_extra_it_needs_to_run(no_torch_env: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    # the launcher is torch-free: its help (and its flags) need no extra
    out = subprocess.run([*CLI, "train", "--help"], env=no_torch_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--nproc" in out.stdout, out.stderr
    for nproc in ("1", "2"):
        out = subprocess.run([*CLI, "train", "--data", "synthetic", "--max-steps", "1", "--nproc", nproc],
                             env=no_torch_env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 2, (nproc, out.stderr)
        assert "tigana[train]" in out.stderr and "Traceback" not in out.stderr, (nproc, out.stderr)


def test_a_run_needs_the_extras_modules_its_settings_use() -> None:
    assert needed(TrainConfig(progress=False)) == ["torch", "torchmetrics"]  # evaluation ends every run
    assert needed(TrainConfig(logdir="runs", progress=True)) == ["torch", "torchmetrics", "tensorboard", "tqdm"]
    assert set(needed(TrainConfig(logdir="runs", progress=True))) == TRAIN_EXTRA
    assert needed(TrainConfig(logdir="runs", progress=True), rank0=False) == ["torch", "torchmetrics"]
    require(TrainConfig(logdir="runs", progress=True))  # this (dev) install has them all


@pytest.mark.parametrize("module", ["torchmetrics", "tensorboard"])
def test_train_lacking_one_module_of_the_extra_says_so_before_it_starts(module: str, tmp_path: Path) -> None:
    # torch present, one other module of the extra missing: the job would have trained and then failed (in
    # the evaluation after its last step, or at rank 0's TensorBoard writer); it stops before a cluster starts
    env = _env_without(tmp_path, {module})
    for nproc in ("1", "2"):
        out = subprocess.run([*CLI, "train", "--data", "synthetic", "--max-steps", "1", "--nproc", nproc,
                              "--logdir", str(tmp_path / "runs")], env=env, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 2, (nproc, out.stderr)
        assert f"needs {module!r}" in out.stderr and "tigana[train]" in out.stderr, (nproc, out.stderr)
        assert "Traceback" not in out.stderr and "cluster" not in out.stderr.lower(), (nproc, out.stderr)
        assert not (tmp_path / "runs").exists()


def test_cluster_admin_and_serve_run_without_torch(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    env = no_torch_env
    with _spawn(["scheduler", "--port", "0", "--data-dir", str(tmp_path / "sched"), "--replicas", "0",
                 "--ready-file", str(tmp_path / "sched.json")], env, tmp_path / "sched.log") as sched:
        scheduler = _ready(tmp_path / "sched.json", sched, tmp_path / "sched.log")["address"]
        with _spawn(["server", "--port", "0", "--data-dir", str(tmp_path / "s0"), "--scheduler", scheduler,
                     "--ready-file", str(tmp_path / "s0.json")], env, tmp_path / "s0.log") as server:
            _ready(tmp_path / "s0.json", server, tmp_path / "s0.log")
            with ps.connect(scheduler=scheduler) as client:
                client.create_table("emb", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
                ids = np.arange(50, dtype=np.int64)
                client.push("emb", ids, np.ones((50, 4), np.float32)).result()
                want = client.pull("emb", ids, insert=False)
                out = tmp_path / "log"
                follow_args = ["admin", "--scheduler", scheduler, "export", "emb", "--follow", "--out", str(out),
                               "--interval", "0.3"]
                with _spawn(follow_args, env, tmp_path / "follow.log") as follow, \
                        _spawn(["serve", "--from", str(out), "--port", "0", "--poll", "0.05", "--ready-file",
                                str(tmp_path / "serve.json")], env, tmp_path / "serve.log") as serve:
                    address = _ready(tmp_path / "serve.json", serve, tmp_path / "serve.log")["address"]
                    deadline = time.monotonic() + 60
                    with ServingClient(address) as serving:
                        while True:
                            assert follow.poll() is None, (tmp_path / "follow.log").read_text()[-3000:]
                            try:
                                rows, found = serving.lookup(ids)
                                break
                            except ps.Unavailable:
                                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                                time.sleep(0.1)
                    assert found.all()
                    np.testing.assert_array_equal(rows, want)
    for log in ("sched.log", "s0.log", "follow.log", "serve.log"):
        assert "No module named" not in (tmp_path / log).read_text(), log
