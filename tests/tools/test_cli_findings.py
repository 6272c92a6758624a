"""The command line as a newcomer meets it (issue 19, section 5): flags after the action, one name per setting,
one clear line and exit 2 for a bad value, ports in range, ``config show`` of every command, a warning for
an unknown ``TIGANA_*`` variable, and ``--help`` where every flag has help, a default and a readable metavar."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tigana.tools import cli
from tigana.tools.env_names import unknown

CLI = [sys.executable, "-m", "tigana.tools.cli"]
COMMANDS = ["server", "scheduler", "serve", "local", "admin", "train", "config", "demo"]


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIGANA_")}
    return subprocess.run([*CLI, *args], env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv", [
    ["admin", "status", "--json", "--scheduler", "127.0.0.1:1"],
    ["admin", "--json", "status", "--scheduler", "127.0.0.1:1"],
    ["admin", "--scheduler", "127.0.0.1:1", "status", "--json"],
])
def test_admin_group_flags_work_before_and_after_the_action(argv: list[str], capsys) -> None:
    rc, out, err = _main(argv, capsys)
    assert rc == 1 and "unrecognized arguments" not in err  # it ran: the scheduler is just not there
    assert json.loads(out.splitlines()[-1])["action"] == "status"
    assert "127.0.0.1:1" in err


def test_errors_show_the_subcommands_usage(capsys) -> None:
    rc, _, err = _main(["admin", "status", "--bogus"], capsys)
    assert rc == 2
    assert "usage: tigana admin status" in err and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(("argv", "flag"), [
    (["scheduler", "--port", "-5"], "--port"),
    (["server", "--port", "70000"], "--port"),
    (["serve", "--from", "x", "--port", "65536"], "--port"),
    (["local", "--base-port", "-1"], "--base-port"),
    (["server", "--log-level", "banana"], "--log-level"),
    (["scheduler", "--log-level", "banana"], "--log-level"),
    (["serve", "--from", "x", "--log-level", "banana"], "--log-level"),
    (["train", "--log-level", "banana"], "--log-level"),
    (["local", "--replicas", "banana"], "--replicas"),
])
def test_a_bad_value_is_one_line_naming_the_flag_with_exit_2(argv: list[str], flag: str, capsys) -> None:
    rc, _, err = _main(argv, capsys)
    assert rc == 2, err
    assert f"argument {flag}:" in err and "Traceback" not in err and "invalid literal" not in err


def test_a_bad_variable_is_one_line_naming_the_field_and_its_source(tmp_path: Path) -> None:
    out = _run("server", "--port", "0", "--data-dir", str(tmp_path / "d"), env={"TIGANA_DRAIN_GRACE": "soon"})
    assert out.returncode == 2, out.stderr
    assert "TIGANA_DRAIN_GRACE" in out.stderr and "drain_grace" in out.stderr and "Traceback" not in out.stderr


def test_one_name_per_setting_in_flags_files_and_variables(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("snapshot-every: 7\ndrain-grace: 3\n")
    out = _run("config", "show", "server", "--json", "--config", str(config),
               env={"TIGANA_HEARTBEAT_INTERVAL": "0.5"})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["config"]["snapshot_every"] == 7.0 and shown["sources"]["snapshot_every"] == f"file {config}"
    assert shown["config"]["drain_grace"] == 3.0
    assert shown["sources"]["heartbeat_interval"] == "env TIGANA_HEARTBEAT_INTERVAL"
    # the old field spellings still work
    config.write_text("snapshot_every_s: 9\n")
    out = _run("config", "show", "server", "--json", "--config", str(config), env={"TIGANA_DRAIN_GRACE_S": "4"})
    shown = json.loads(out.stdout)
    assert (shown["config"]["snapshot_every"], shown["config"]["drain_grace"]) == (9.0, 4.0)
    # an unknown key names the accepted ones by their one name
    config.write_text("snapshot-evry: 9\n")
    out = _run("config", "show", "server", "--config", str(config))
    assert out.returncode == 2 and "'snapshot-every'" in out.stderr


def test_config_show_without_a_target_shows_every_command() -> None:
    out = _run("config", "show", "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert set(shown) == {"server", "scheduler", "serve", "train"}
    assert shown["serve"]["config"]["port"] == 0
    out = _run("config", "show")
    assert [line for line in out.stdout.splitlines() if line.startswith("[")] == [
        "[server]", "[scheduler]", "[serve]", "[train]"]


def test_unknown_tigana_variables_are_warned_about() -> None:
    env = {"TIGANA_SNAPSHOT_EVRY": "5", "TIGANA_SNAPSHOT_EVERY": "5", "TIGANA_BATCH_SIZE": "64",
           "TIGANA_SCHEDULER_REPLICAS": "1", "TIGANA_SLURM_TRAIN_GRACE": "60", "TIGANA_SCHEDULER": "h:1"}
    assert unknown(env) == ["TIGANA_SNAPSHOT_EVRY"]
    out = _run("config", "show", "server", env=env)
    assert out.returncode == 0
    assert "TIGANA_SNAPSHOT_EVRY is not a setting of any tigana command" in out.stderr
    assert "TIGANA_BATCH_SIZE" not in out.stderr and "TIGANA_SNAPSHOT_EVERY " not in out.stderr


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser with its module's flags, and every nested action's (admin status, ...)."""
    out = []
    for command in COMMANDS:
        parser = cli.build_parser()
        module = __import__(cli.COMMANDS[command][0], fromlist=["run"])
        stack = [(command, cli._attach(parser, [command], module))]
        while stack:
            name, p = stack.pop()
            out.append((name, p))
            for action in p._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack.extend((f"{name} {n}", child) for n, child in action.choices.items())
    return out


def test_every_flag_has_help_a_default_and_a_readable_metavar() -> None:
    missing, internal = [], []
    for name, parser in _parsers():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if action.help == argparse.SUPPRESS:
                continue
            if not action.help or "default" not in action.help:
                missing.append(f"tigana {name} {action.option_strings[-1]}")
        text = parser.format_help()
        internal += [f"tigana {name}: {m}" for m in re.findall(r"--[\w-]+ ([A-Z][A-Z_]*_S|[A-Z]+_)\b", text)]
    assert not missing, f"flags without help or default: {missing}"
    assert not internal, f"internal metavars: {internal}"


def test_local_keeps_the_daemons_logs_and_json_logs_are_json_throughout(tmp_path: Path) -> None:
    """``tigana local --log-dir``: the daemons' logs outlive the temp data dir; with ``--log-format json`` every
    line they write, lifecycle lines included, is a JSON object."""
    import signal

    logs = tmp_path / "logs"
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIGANA_")}
    proc = subprocess.Popen([*CLI, "local", "--shards", "1", "--replicas", "0", "--log-dir", str(logs),
                             "--log-format", "json"], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()  # the address, once every daemon serves
        assert first.strip(), proc.stderr.read()[-3000:]
        assert f"logs in {logs}" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    for name in ("scheduler.log", "shard-0.log"):
        lines = (logs / name).read_text().splitlines()
        assert lines, name
        records = [json.loads(line) for line in lines]  # every line parses
        assert any("serving on" in json.dumps(r) for r in records), name
