"""The README's commands are real: every ``tigana ...`` line in its code blocks parses with the CLI exactly as
typed (an unknown flag or subcommand fails here), and its configuration example loads for every command."""

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

from tigana.ps.config import load_server_config
from tigana.ps.scheduler import load_scheduler_config
from tigana.tools import cli
from tigana.trainer.config import load_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)


def _commands() -> list[str]:
    out = []
    for lang, body in _blocks(README.read_text()):
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


COMMANDS = _commands()


def test_the_readme_shows_commands() -> None:
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("line", COMMANDS)
def test_every_readme_command_parses(line: str) -> None:
    argv = shlex.split(line)[1:]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _parse(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                pytest.fail(f"README command does not parse: {line}\n{err.getvalue()}")


def test_the_configuration_example_loads(tmp_path: Path) -> None:
    text = README.read_text()
    example = next(body for lang, body in _blocks(text) if lang == "yaml" and "server:" in body)
    path = tmp_path / "tigana.yaml"
    path.write_text(example)
    doc = yaml.safe_load(example)
    assert load_server_config({"config": str(path)}, env={}).port == doc["server"]["port"]
    assert load_scheduler_config({"config": str(path)}, env={}).config.replicas == doc["scheduler"]["replicas"]
    assert load_config(path, environ={}).batch_size == doc["train"]["batch_size"]
