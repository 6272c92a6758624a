"""A shard server's failure domain setting (``ServerConfig.domain``): ``--domain`` > ``TIGANA_DOMAIN`` > the config
file's ``domain`` key (text or a mapping) > the default (the host is the machine's name); a bad value is refused
naming the field and where it came from."""

from __future__ import annotations

import pytest

from tigana.ps.domains import FailureDomain
from tigana.ps.errors import InvalidArgument
from tigana.ps.shard.config import ServerConfig, load_server_config, load_server_config_sources


def test_flag_beats_env_beats_file(tmp_path):
    yaml = tmp_path / "server.yaml"
    yaml.write_text("server:\n  domain:\n    zone: eu-1a\n    rack: r7\n")
    assert load_server_config(env={}, file=yaml).domain == "zone=eu-1a,rack=r7"
    env = {"TIGANA_DOMAIN": "zone=eu-1b,host=node-3"}
    loaded = load_server_config_sources(env=env, file=yaml)
    assert loaded.config.domain == "zone=eu-1b,host=node-3" and loaded.sources["domain"] == "env TIGANA_DOMAIN"
    loaded = load_server_config_sources({"domain": "host=node-9"}, env=env, file=yaml)
    assert loaded.config.domain == "host=node-9" and loaded.sources["domain"] == "flag --domain"
    toml = tmp_path / "server.toml"
    toml.write_text('domain = "rack=r1, zone=z"\n')
    assert load_server_config(env={}, file=toml).domain == "zone=z,rack=r1"  # one spelling


def test_the_host_defaults_to_the_machines_name():
    assert ServerConfig().failure_domain("box-1") == FailureDomain(host="box-1")
    assert ServerConfig(domain="zone=a").failure_domain("box-1") == FailureDomain("a", "", "box-1")
    assert ServerConfig(domain="zone=a,host=pod-node").failure_domain("box-1") == FailureDomain("a", "", "pod-node")
    assert ServerConfig().failure_domain().host  # socket.gethostname()


@pytest.mark.parametrize("flags,env,where", [
    ({"domain": "region=eu"}, {}, "flag --domain"),
    ({}, {"TIGANA_DOMAIN": "host=a,host=b"}, "environment variable TIGANA_DOMAIN"),
    ({}, {"TIGANA_DOMAIN": "zone"}, "environment variable TIGANA_DOMAIN"),
])
def test_a_bad_domain_is_refused_naming_field_and_source(flags, env, where):
    with pytest.raises(InvalidArgument) as err:
        load_server_config(flags, env=env)
    assert "'domain'" in str(err.value) and where in str(err.value)
    with pytest.raises(InvalidArgument, match="'domain'"):
        ServerConfig(domain="rack=a=b")
