"""Layered settings, the same for every command: flags > TIGANA_* variables > config file > defaults, with
where each value came from; ``tigana config show``; ``--help`` shows every default; StatefulSet identity."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tigana.ps import settings
from tigana.ps.errors import InvalidArgument
from tigana.ps.scheduler import load_scheduler_config
from tigana.ps.shard.config import load_server_config_sources, statefulset_identity
from tigana.tools import cli
from tigana.trainer.config import ConfigError, load_config_sources


@dataclass(frozen=True)
class Demo:
    port: int = 1
    ratio: float = 0.5
    name: str | None = None
    hosts: tuple[str, ...] = ()
    flag: bool = False


@given(flag=st.one_of(st.none(), st.integers(0, 99)), env=st.one_of(st.none(), st.integers(100, 199)),
       file=st.one_of(st.none(), st.integers(200, 299)))
def test_the_highest_source_given_wins_and_is_named(tmp_path_factory, flag, env, file) -> None:
    path = None
    if file is not None:
        path = tmp_path_factory.mktemp("cfg") / "demo.yaml"
        path.write_text(f"port: {file}\n")
    loaded = settings.load(Demo, flags={"port": flag}, env={} if env is None else {"TIGANA_PORT": str(env)},
                           file=path)
    expected = next((v for v in (flag, env, file) if v is not None), 1)
    assert loaded.config.port == expected
    source = loaded.sources["port"]
    if flag is not None:
        assert source == "flag --port"
    elif env is not None:
        assert source == "env TIGANA_PORT"
    elif file is not None:
        assert source == f"file {path}"
    else:
        assert source == "default"


def test_types_sections_and_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "all.toml"
    cfg.write_text('[demo]\nhosts = ["a:1", "b:2"]\nflag = true\n')
    loaded = settings.load(Demo, file=cfg, section="demo", env={"TIGANA_RATIO": "0.25", "TIGANA_NAME": "none"})
    assert loaded.config == Demo(ratio=0.25, hosts=("a:1", "b:2"), flag=True)
    assert settings.load(Demo, env={"TIGANA_HOSTS": "x:1, y:2"}).config.hosts == ("x:1", "y:2")
    with pytest.raises(InvalidArgument, match="TIGANA_PORT.*'port'"):
        settings.load(Demo, env={"TIGANA_PORT": "many"})
    with pytest.raises(InvalidArgument, match="unknown field 'prot'"):
        (tmp_path / "bad.yaml").write_text("prot: 3\n")
        settings.load(Demo, file=tmp_path / "bad.yaml")
    with pytest.raises(InvalidArgument, match="flag --flag"):
        settings.load(Demo, flags={"flag": "maybe"})


def test_every_daemon_and_training_use_the_same_layers(tmp_path: Path) -> None:
    yaml_file = tmp_path / "tigana.yaml"
    yaml_file.write_text("server:\n  port: 7200\n  memory_budget: 1GiB\nscheduler:\n  replicas: 2\n"
                         "train:\n  batch_size: 64\n")
    server = load_server_config_sources({"config": str(yaml_file), "dedup_window": 99},
                                        env={"TIGANA_HEARTBEAT_INTERVAL_S": "0.25"})
    assert (server.config.port, server.config.memory_budget, server.config.dedup_window) == (7200, 1 << 30, 99)
    assert server.sources["port"] == f"file {yaml_file}" and server.sources["dedup_window"] == "flag --dedup-window"
    assert server.sources["heartbeat_interval_s"] == "env TIGANA_HEARTBEAT_INTERVAL_S"
    sched = load_scheduler_config({"config": str(yaml_file)},
                                  env={"TIGANA_SCHEDULER_PORT": "7100", "TIGANA_PORT": "1", "TIGANA_LEADER_TTL_S": "4"})
    assert (sched.config.replicas, sched.config.port, sched.config.leader_ttl_s) == (2, 7100, 4)
    assert sched.sources["port"] == "env TIGANA_SCHEDULER_PORT"  # the scheduler's own variable wins
    train = load_config_sources(yaml_file, {"epochs": 3}, environ={"TIGANA_LR": "0.01"})
    assert (train.config.batch_size, train.config.epochs, train.config.lr) == (64, 3, 0.01)
    assert train.sources["lr"] == "env TIGANA_LR"
    with pytest.raises(ConfigError, match="batch_size"):
        load_config_sources(None, {"batch_size": "lots"}, environ={})


def test_statefulset_ordinal_gives_the_server_id(tmp_path: Path) -> None:
    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    values: dict = {"data_dir": str(tmp_path)}
    sources: dict = {}
    statefulset_identity(values, sources, k8s, hostname="tigana-shard-3")
    assert values["server_id"] == "tigana-shard-3" and sources["server_id"] == "StatefulSet hostname"
    for env, host, given_id in ((k8s, "laptop", None), ({}, "tigana-shard-3", None), (k8s, "tigana-shard-3", "x")):
        values = {"data_dir": str(tmp_path), "server_id": given_id}
        statefulset_identity(values, {}, env, hostname=host)
        assert values["server_id"] == given_id  # not in Kubernetes, no ordinal, or a flag gave one
    (tmp_path / "server-id").write_text("abc\n")
    values = {"data_dir": str(tmp_path)}
    statefulset_identity(values, {}, k8s, hostname="tigana-shard-3")
    assert "server_id" not in values  # the stored id stays


def test_config_show_prints_values_and_sources(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIGANA_MAX_WORKERS", "8")
    assert cli.main(["config", "show", "server", "--sources", "--port", "7000"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["port"].split()[1] == "7000" and lines["port"].endswith("# flag --port")
    assert lines["max_workers"].endswith("# env TIGANA_MAX_WORKERS")
    assert lines["dedup_window"].endswith("# default")
    assert cli.main(["config", "show", "scheduler", "--json", "--replicas", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["replicas"] == 3 and doc["sources"]["replicas"] == "flag --replicas"
    assert cli.main(["config", "show", "train", "--batch-size", "32"]) == 0
    assert "batch_size" in capsys.readouterr().out
    monkeypatch.setenv("TIGANA_PORT", "not-a-port")
    assert cli.main(["config", "show", "server"]) == 2
    assert "TIGANA_PORT" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["server", "scheduler", "train", "local", "demo", "admin"])
def test_help_shows_every_flags_default(command, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "(default: " in capsys.readouterr().out
    module = __import__(cli.COMMANDS[command][0], fromlist=["add_arguments"])
    parser = cli.build_parser()
    cli._attach(parser, [command], module)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    parsers, missing = [sub], []
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and not isinstance(action, argparse._HelpAction) and action.dest not in (
                    "config", "ready_file") and action.help is not None and "default" not in action.help:
                missing.append(action.option_strings[-1])
    assert not missing, f"tigana {command}: flags whose --help shows no default: {missing}"
