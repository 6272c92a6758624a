"""The README and the guides in ``docs/`` are real: every ``tigana ...`` line in their code blocks parses with the
CLI exactly as typed (an unknown flag or subcommand fails here), the configuration example loads for every
command, the README starts a cluster in the order the daemons need (the scheduler first), it links every guide,
and every relative link and anchor in them leads somewhere."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tigana.ps.scheduler import load_scheduler_config
from tigana.ps.shard.config import load_server_config
from tigana.tools import cli
from tigana.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)


def _commands(page: Path) -> list[str]:
    out = []
    for lang, body in _blocks(page.read_text()):
        if lang not in ("", "sh", "bash", "console"):
            continue
        joined = body.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("tigana ") and "..." not in line:
                out.append(re.sub(r"\[(--[^\]]*)\]", r"\1", line))  # optional parts: check them too
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = cli.build_parser()
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    module = importlib.import_module(known._module)
    parser = cli.build_parser()
    cli._attach(parser, argv, module)
    return parser.parse_args(argv)


COMMANDS = [(page.relative_to(ROOT).as_posix(), line) for page in PAGES for line in _commands(page)]


def test_the_pages_show_commands() -> None:
    # 41 when everything was in the README; a page that stops being read here would drop the count.
    assert len(COMMANDS) >= 41
    assert len([c for c in COMMANDS if c[0] == "README.md"]) >= 5


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_every_command_parses(page: str, line: str) -> None:
    argv = shlex.split(line)[1:]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _parse(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                pytest.fail(f"{page}: command does not parse: {line}\n{err.getvalue()}")


def test_the_readme_starts_the_scheduler_before_its_servers() -> None:
    """The start-up a new user copies: a scheduler, then at least two servers naming it, in that order."""
    lines = [c for p, c in COMMANDS if p == "README.md" and c.split()[1] in ("scheduler", "server")]
    assert lines and lines[0].split()[1] == "scheduler", lines
    port = _parse(shlex.split(lines[0])[1:]).port
    servers = [_parse(shlex.split(c)[1:]) for c in lines[1:]]
    assert len(servers) >= 2 and all(s.scheduler == f"127.0.0.1:{port}" for s in servers), lines


def test_the_configuration_example_loads(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = next(body for lang, body in _blocks(text) if lang == "yaml" and "server:" in body)
    path = tmp_path / "tigana.yaml"
    path.write_text(example)
    doc = yaml.safe_load(example)
    assert load_server_config({"config": str(path)}, env={}).port == doc["server"]["port"]
    assert load_scheduler_config({"config": str(path)}, env={}).config.replicas == doc["scheduler"]["replicas"]
    assert load_config(path, environ={}).batch_size == doc["train"]["batch_size"]


def test_the_readme_links_every_guide() -> None:
    linked = {m for m in re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text())}
    assert DOCS and {d.relative_to(ROOT).as_posix() for d in DOCS} <= linked


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to a missing file: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: link to a missing heading: {target}"
