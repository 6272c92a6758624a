"""Packaging: every folder with an __init__.py is listed in pyproject, code imports tigana.<x> only, and
``import tigana.ps`` loads the client, not the server."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP = {"embeddings", "ps", "trainer", "proto", "tools"}
# The one exception: the testing room (the simulator, the fault harness, the nemesis) is testing code, in a
# checkout only. It is never listed, so a wheel never ships it; an editable install imports it from tools/.
TESTING_ROOM = "tools/testing"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found, testing = set(), set()
    for top in TOP:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            if rel == TESTING_ROOM or rel.startswith(TESTING_ROOM + "/"):
                testing.add("tigana." + rel.replace("/", "."))
                continue
            found.add("tigana." + rel.replace("/", "."))
            assert setuptools["package-dir"]["tigana." + rel.replace("/", ".")] == rel
    assert found == listed
    assert testing, f"{TESTING_ROOM} holds no package"
    assert not testing & (listed | set(setuptools["package-dir"])), "the testing room must stay out of the wheel"


def test_no_bare_imports_of_top_level_folders() -> None:
    bare = re.compile(r"^\s*(from|import)\s+(" + "|".join(TOP) + r")(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(ROOT)) for top in [*TOP, "tests"] for p in (ROOT / top).rglob("*.py")
                 if bare.search(p.read_text())]
    assert offenders == [], f"import tigana.<x>, not the bare folder: {offenders}"


def test_import_tigana_ps_loads_the_client_and_no_server() -> None:
    """``import tigana.ps`` (and a client made by ``ps.connect``) loads none of the shard server, the scheduler,
    replication or the cluster launchers (``ops``); the server-side public names still resolve, on first use."""
    code = textwrap.dedent("""
        import json, sys
        import tigana.ps as ps
        server = ("tigana.ps.shard", "tigana.ps.scheduler", "tigana.ps.replication", "tigana.ps.ops")
        def loaded():
            return sorted(m for m in sys.modules if m.startswith(server))
        after_import = loaded()
        client = ps.connect(["127.0.0.1:1", "127.0.0.1:2"], timeout_s=0.5)  # a static list: no server answers
        addresses = client.addresses
        client.close()
        after_connect = loaded()
        names = {n: f"{getattr(ps, n).__module__}.{getattr(ps, n).__name__}"
                 for n in ("start_server", "ServerConfig", "ServerHandle", "load_server_config", "LocalCluster",
                           "LocalEtcd", "start_scheduler", "SchedulerConfig", "SchedulerHandle")}
        missing = [n for n in ps.__all__ if not hasattr(ps, n) or n not in dir(ps)]
        print(json.dumps({"after_import": after_import, "after_connect": after_connect, "addresses": addresses,
                          "names": names, "missing": missing}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["after_import"] == [], seen["after_import"]
    assert seen["after_connect"] == [], seen["after_connect"]
    assert seen["addresses"] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert seen["names"] == {
        "start_server": "tigana.ps.shard.daemon.start_server",
        "ServerConfig": "tigana.ps.shard.config.ServerConfig",
        "ServerHandle": "tigana.ps.shard.daemon.ServerHandle",
        "load_server_config": "tigana.ps.shard.config.load_server_config",
        "LocalCluster": "tigana.ps.ops.local.LocalCluster",
        "LocalEtcd": "tigana.ps.ops.local.LocalEtcd",
        "start_scheduler": "tigana.ps.scheduler.daemon.start_scheduler",
        "SchedulerConfig": "tigana.ps.scheduler.config.SchedulerConfig",
        "SchedulerHandle": "tigana.ps.scheduler.daemon.SchedulerHandle",
    }
    assert seen["missing"] == []
