"""Packaging: every folder with an __init__.py is listed in pyproject, and code imports tigana.<x> only."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP = {"embeddings", "ps", "trainer", "proto", "tools"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for top in TOP:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            found.add("tigana." + rel.replace("/", "."))
            assert setuptools["package-dir"]["tigana." + rel.replace("/", ".")] == rel
    assert found == listed


def test_no_bare_imports_of_top_level_folders() -> None:
    bare = re.compile(r"^\s*(from|import)\s+(" + "|".join(TOP) + r")(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(ROOT)) for top in [*TOP, "tests"] for p in (ROOT / top).rglob("*.py")
                 if bare.search(p.read_text())]
    assert offenders == [], f"import tigana.<x>, not the bare folder: {offenders}"
