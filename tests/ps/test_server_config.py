"""ServerConfig: size parsing and the precedence flags > TIGANA_* env > config file > defaults."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tigana.ps.errors import InvalidArgument
from tigana.ps.settings import parse_bytes
from tigana.ps.shard.config import ServerConfig, load_server_config


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1048576", 1 << 20), ("1.5GiB", 3 << 29), ("2gib", 2 << 30),
    ("10KB", 10_000), ("3M", 3_000_000), ("4Ki", 4096), (" 7 B ", 7), ("1TiB", 1 << 40), (4096, 4096),
])
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "8 gigs", "1e9", "8GiBs", "nan"])
def test_parse_bytes_rejects_and_names_the_field(text) -> None:
    with pytest.raises(InvalidArgument, match="memory_budget"):
        parse_bytes(text, field="memory_budget")


@given(st.integers(min_value=0, max_value=1 << 50))
def test_plain_byte_counts_round_trip(n: int) -> None:
    assert parse_bytes(str(n)) == n


def test_defaults() -> None:
    cfg = load_server_config({}, env={})
    assert cfg == ServerConfig()
    assert cfg.owned_slots().all() and cfg.owned_slots().shape == (cfg.num_slots,)
    assert cfg.max_message_bytes == 64 << 20


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    yaml_file = tmp_path / "shard.yaml"
    yaml_file.write_text("server:\n  port: 7000\n  memory-budget: 1GiB\n  slots: 0-99\n  max_workers: 3\n"
                         "  metrics_port: 9100\n")
    env = {"TIGANA_PORT": "7100", "TIGANA_MEMORY_BUDGET": "2GiB", "TIGANA_UNRELATED": "x"}
    flags = {"port": 7200, "memory_budget": None, "config": str(yaml_file)}
    cfg = load_server_config(flags, env=env)
    assert cfg.port == 7200                 # flag
    assert cfg.memory_budget == 2 << 30     # env beats file
    assert cfg.slots == "0-99"              # file
    assert cfg.max_workers == 3             # file
    assert cfg.metrics_port == 9100
    assert cfg.host == "127.0.0.1"          # default
    np.testing.assert_array_equal(np.flatnonzero(cfg.owned_slots()), np.arange(100))


def test_toml_file_and_config_from_env(tmp_path: Path) -> None:
    toml_file = tmp_path / "shard.toml"
    toml_file.write_text('data_dir = "/srv/shard"\nnum_slots = 64\nslots = "0-31"\nmax_message_bytes = "16MiB"\n')
    cfg = load_server_config({}, env={"TIGANA_CONFIG": str(toml_file), "TIGANA_METRICS_PORT": "auto"})
    assert cfg.data_dir == "/srv/shard"
    assert cfg.num_slots == 64 and cfg.owned_slots().sum() == 32
    assert cfg.max_message_bytes == 16 << 20
    assert cfg.metrics_port == -1


@pytest.mark.parametrize(("flags", "env", "field"), [
    ({"port": 70000}, {}, "port"),
    ({}, {"TIGANA_PORT": "seventy"}, "TIGANA_PORT"),
    ({}, {"TIGANA_MEMORY_BUDGET": "lots"}, "TIGANA_MEMORY_BUDGET"),
    ({"slots": "0-5000"}, {}, "slots"),
    ({"max_workers": 0}, {}, "max_workers"),
])
def test_bad_values_name_their_source_and_field(flags, env, field) -> None:
    with pytest.raises(InvalidArgument, match=field):
        load_server_config(flags, env=env)


def test_bad_file_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 1\nportt: 2\n")
    with pytest.raises(InvalidArgument, match="portt"):
        load_server_config({"config": str(bad)}, env={})
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_server_config({"config": str(tmp_path / "missing.yaml")}, env={})
